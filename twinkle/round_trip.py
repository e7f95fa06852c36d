"""Commands sent together in one round trip on a redis-py client, without its pipeline's layers.

A redis-py pipeline encodes each argument in Python before hiredis packs it, and since 8.x looks for field-set
imports and records observability attributes around every command: about 50 µs a pipeline on top of the round
trip (measured on a pipeline of three scripts, 146 against 90 µs). A pool worker sends two or three such
pipelines an op, so this is a tenth of its CPU. Here hiredis packs the commands at once and the replies are read
as the pipeline would read them: a reply's response callback applied, an error reply in its place. The API's
asyncio client sends its scripts the same way (`send_together_async`): a submit's script has some 60 arguments.

It keeps what matters of the pipeline: a connection from the client's pool, checked before use; the client's
retry policy on connection errors (the pool worker rides out a broker restart with it); a connection whose
replies were not all read is dropped, never handed back half read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from hiredis import pack_command
from redis.exceptions import ResponseError

Command = Sequence[Any]  # str, bytes, int or float arguments, as redis-py takes them


def send_together(r: redis.Redis, commands: Sequence[Command]) -> list[Any]:
    """The replies of `commands`, in order, each with its response callback applied, or the ResponseError
    that command got (the others still ran). Raises on connection errors the client's retries did not cure."""
    packed = _packed(commands)
    pool = r.connection_pool
    connection = pool.get_connection()
    try:
        raw = connection.retry.call_with_retry(lambda: _exchange(connection, packed, len(commands)),
                                               lambda _error: connection.disconnect())
    finally:
        pool.release(connection)
    return _decoded(r.response_callbacks, commands, raw)


async def send_together_async(r: aioredis.Redis, commands: Sequence[Command]) -> list[Any]:
    """`send_together` on an asyncio client. A cancelled exchange drops its connection (redis-py's own reads
    and writes do so), so no reply is left for the next borrower."""
    packed = _packed(commands)
    pool = r.connection_pool
    connection = await pool.get_connection()
    try:
        raw = await connection.retry.call_with_retry(lambda: _exchange_async(connection, packed, len(commands)),
                                                     lambda _error: connection.disconnect())
    finally:
        await pool.release(connection)
    return _decoded(r.response_callbacks, commands, raw)


def checked(replies: list[Any]) -> list[Any]:
    """`replies` as they are, or the first error among them raised."""
    failed = next((reply for reply in replies if isinstance(reply, Exception)), None)
    if failed is not None:
        raise failed
    return replies


def evalsha(sha: str, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
    """The command that runs a loaded script."""
    return ("EVALSHA", sha, len(keys), *keys, *args)


def _packed(commands: Sequence[Command]) -> list[bytes]:
    try:
        return [b"".join(pack_command(tuple(command)) for command in commands)]  # type: ignore[arg-type]
    except TypeError as error:  # None, a bool, any other type: refused as redis-py refuses it
        raise redis.DataError(f"Invalid input in a Redis command: {error} Convert it to bytes, str, int or float "
                              "first.") from error


def _decoded(callbacks: Any, commands: Sequence[Command], raw: list[Any]) -> list[Any]:
    return [reply if isinstance(reply, ResponseError) or (callback := callbacks.get(_name(command))) is None
            else callback(reply) for command, reply in zip(commands, raw, strict=True)]


def _exchange(connection: Any, packed: list[bytes], count: int) -> list[Any]:
    connection.send_packed_command(packed)
    replies: list[Any] = []
    try:
        for _ in range(count):
            try:
                replies.append(connection.read_response())
            except ResponseError as error:
                replies.append(error)
    except BaseException:
        connection.disconnect()  # replies left on the socket must not reach the next borrower
        raise
    return replies


async def _exchange_async(connection: Any, packed: list[bytes], count: int) -> list[Any]:
    await connection.send_packed_command(packed)
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(await connection.read_response())
        except ResponseError as error:
            replies.append(error)
    return replies


def _name(command: Command) -> str:
    name = command[0]
    return (name.decode() if isinstance(name, bytes) else str(name)).upper()
