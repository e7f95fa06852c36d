"""The ledger on an asyncio client: the API."""

from __future__ import annotations

from typing import TypeVar

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from twinkle.ledger.call import Call
from twinkle.round_trip import checked, evalsha, send_together_async

T = TypeVar("T")


class AsyncLedger:
    def __init__(self, r: aioredis.Redis) -> None:
        self.r = r
        self._scripts: dict[str, AsyncScript] = {}

    async def run(self, call: Call[T]) -> T:
        """One round trip: the script (EVALSHA, loaded once when the server lacks it), or the commands sent
        together (in MULTI/EXEC for an atomic call)."""
        if call.script:
            script = self._registered(call.script)
            [reply] = await send_together_async(self.r, [evalsha(script.sha, call.keys, call.args)])
            if isinstance(reply, NoScriptError):  # a broker that never ran it, or restarted: this loads it
                reply = await script(keys=call.keys, args=call.args)
            elif isinstance(reply, Exception):
                raise reply
            return call.decode(reply)
        if not call.atomic:
            return call.decode(checked(await send_together_async(self.r, call.commands)))
        pipe = self.r.pipeline(transaction=True)
        for command in call.commands:
            pipe.execute_command(*command)
        return call.decode(await pipe.execute())

    def _registered(self, source: str) -> AsyncScript:
        registered = self._scripts.get(source)
        if registered is None:
            registered = self._scripts[source] = self.r.register_script(source)
        return registered
