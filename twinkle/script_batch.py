"""Several Redis scripts in one round trip: each sent as EVALSHA in one pipeline, and any the server lacks (a
restarted broker forgot its loaded scripts) run again on its own, which loads it.

A pipeline of registered scripts would not do: redis-py asks the server which of them it has (SCRIPT EXISTS)
before every such pipeline, one more round trip than the calls saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from twinkle.round_trip import evalsha, send_together


@dataclass(frozen=True)
class ScriptCall:
    script: Script
    keys: Sequence[str]
    args: Sequence[Any]


def run_together(r: redis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """The replies of `calls`, in order; where one call failed, its error in its place (the others still ran).
    Raises only when the broker cannot be reached at all."""
    replies = send_together(r, [evalsha(call.script.sha, call.keys, call.args) for call in calls])
    for index, (call, reply) in enumerate(zip(calls, replies, strict=True)):
        if isinstance(reply, NoScriptError):
            try:
                replies[index] = call.script(keys=call.keys, args=call.args)
            except redis.ResponseError as error:
                replies[index] = error
    return replies
