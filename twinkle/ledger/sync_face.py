"""The ledger on a blocking client: pool workers, the launcher, the hang watch, the queue-timeout sweep."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from twinkle.ledger.call import Call
from twinkle.round_trip import checked, evalsha, send_together
from twinkle.script_batch import ScriptCall, run_together

T = TypeVar("T")
U = TypeVar("U")


class SyncLedger:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._scripts: dict[str, Script] = {}

    def run(self, call: Call[T]) -> T:
        """One round trip: the script (EVALSHA, loaded once when the server lacks it), or the commands sent
        together (in MULTI/EXEC for an atomic call)."""
        if call.script:
            [reply] = checked(run_together(self.r, [self._script_call(call)]))  # a missing script is loaded
            return call.decode(reply)
        if not call.atomic:
            return call.decode(checked(send_together(self.r, call.commands)))
        pipe = self.r.pipeline(transaction=True)
        for command in call.commands:
            pipe.execute_command(*command)
        return call.decode(pipe.execute())

    def run_then(self, call: Call[T], then: Call[U]) -> tuple[T, U | Exception]:
        """The script `call`, then the commands of `then`, in one round trip (not atomic: `then` sees what the
        script wrote). The script's answer, and `then`'s or the error it got; raises the script's error."""
        script = self._registered(call.script)
        assert not then.script and not then.atomic, "only plain commands go after a script"
        first, *rest = send_together(self.r, [evalsha(script.sha, call.keys, call.args), *then.commands])
        if isinstance(first, NoScriptError):  # a restarted broker forgot it: run on its own, which loads it
            first = script(keys=call.keys, args=call.args)
        elif isinstance(first, Exception):
            raise first
        failed = next((reply for reply in rest if isinstance(reply, Exception)), None)
        return call.decode(first), failed if failed is not None else then.decode(rest)

    def run_with(self, call: Call[T], along: Sequence[Call[Any] | ScriptCall]) -> tuple[T, list[Any]]:
        """The script `call` and, after it in the same round trip, the scripts `along` (the ledger's own calls or
        others' registered scripts, twinkle.script_batch): the call's answer, and the replies of the others in
        order, decoded where they are the ledger's (an error in the place of one that failed)."""
        sent = [self._script_call(call), *(self._script_call(c) if isinstance(c, Call) else c for c in along)]
        replies = run_together(self.r, sent)
        if isinstance(replies[0], Exception):
            raise replies[0]
        return call.decode(replies[0]), [c.decode(reply) if isinstance(c, Call) and not isinstance(reply, Exception)
                                         else reply for c, reply in zip(along, replies[1:], strict=True)]

    def _script_call(self, call: Call[Any]) -> ScriptCall:
        assert call.script, "only a script call is sent along with others"
        return ScriptCall(self._registered(call.script), call.keys, call.args)

    def _registered(self, source: str) -> Script:
        registered = self._scripts.get(source)
        if registered is None:
            registered = self._scripts[source] = self.r.register_script(source)
        return registered
