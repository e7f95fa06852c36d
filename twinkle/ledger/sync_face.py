"""The ledger on a blocking client: pool workers, the launcher, the hang watch, the queue-timeout sweep."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import redis
from redis.commands.core import Script

from twinkle.ledger.call import Call
from twinkle.script_batch import ScriptCall, run_together

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

    def run_with(self, call: Call[T], along: Sequence[ScriptCall]) -> tuple[T, list[Any]]:
        """The script `call` and, after it in the same round trip, the scripts `along` (twinkle.script_batch): the
        call's answer, and the replies of the others in order (an error in the place of one that failed)."""
        assert call.script, "only a script call is sent along with others"
        replies = run_together(self.r, [ScriptCall(self._registered(call.script), call.keys, call.args), *along])
        if isinstance(replies[0], Exception):
            raise replies[0]
        return call.decode(replies[0]), replies[1:]

    def _registered(self, source: str) -> Script:
        registered = self._scripts.get(source)
        if registered is None:
            registered = self._scripts[source] = self.r.register_script(source)
        return registered
