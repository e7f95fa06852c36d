"""The ledger on a blocking client: pool workers, the launcher, the hang watch, the queue-timeout sweep."""

from __future__ import annotations

from typing import Any, TypeVar

import redis
from redis.commands.core import Script

from twinkle.ledger.call import Call

T = TypeVar("T")


class SyncLedger:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._scripts: dict[str, Script] = {}

    def run(self, call: Call[T]) -> T:
        """One round trip: the script (EVALSHA, loaded once when the server lacks it), the one command, or the
        commands in one pipeline."""
        if call.script:
            return call.decode(self._registered(call.script)(keys=call.keys, args=call.args))
        if len(call.commands) == 1 and not call.atomic:
            return call.decode([self.r.execute_command(*call.commands[0])])
        pipe = self.r.pipeline(transaction=call.atomic)
        for command in call.commands:
            pipe.execute_command(*command)
        replies: list[Any] = pipe.execute()
        return call.decode(replies)

    def _registered(self, source: str) -> Script:
        registered = self._scripts.get(source)
        if registered is None:
            registered = self._scripts[source] = self.r.register_script(source)
        return registered
