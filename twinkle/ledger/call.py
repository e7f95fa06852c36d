"""One round trip to Redis, described without a client: what both faces of the ledger run.

A call is a script with its KEYS and ARGV, or plain commands sent together in one pipeline, and the function
that turns the reply into the answer. The functions that build calls (the ledger's `lifecycle`, `queued`,
`saves` and `messages` modules) are plain and know no client, so the sync face and the async face run exactly
the same operations and decode their replies the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
Arg = str | bytes | int | float
Command = tuple[Arg, ...]  # a Redis command's name, then its arguments


@dataclass(frozen=True)
class Call(Generic[T]):
    """`decode` receives the script's reply or, for plain commands, the list of their replies in order."""

    decode: Callable[[Any], T]
    script: str = ""
    keys: Sequence[str] = ()
    args: Sequence[Arg] = ()
    commands: Sequence[Command] = ()
    atomic: bool = False  # commands in MULTI/EXEC, for a write of several keys that must not be seen half done

    def stage(self, pipe: Any) -> None:
        """Queue the call's commands on a caller's pipeline (sync or async), to be sent with the caller's own
        reads; `decode` the list of the replies these commands got."""
        assert not self.script, "a script runs on its own: a pipeline would check it exists first"
        assert not self.atomic, "an atomic call runs in a transaction of its own"
        for command in self.commands:
            pipe.execute_command(*command)


def script(source: str, keys: Sequence[str], args: Sequence[Arg], decode: Callable[[Any], T]) -> Call[T]:
    return Call(decode, script=source, keys=keys, args=args)


def commands(*sent: Command, decode: Callable[[list[Any]], T], atomic: bool = False) -> Call[T]:
    return Call(decode, commands=sent, atomic=atomic)


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
