"""Many queued futures at once: failing those still queued, and taking ended ones out of their key's backlog.

The callers (twinkle/queued_ops.py, the API's lost-request check) choose the ids and pace the batches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from twinkle.backlog import BacklogKeys
from twinkle.keys import Keys
from twinkle.ledger import scripts
from twinkle.ledger.call import Call, script


def fail_queued(keys: Keys, request_ids: Sequence[str], *, error: str, code: str, category: str, ttl: int = 0,
                created_before: float = 0.0, model_id: str = "") -> Call[list[int]]:
    """Fail the records of `request_ids` that are still queued (and created before `created_before`, of `model_id`,
    when given) in one atomic step, as a worker's finish would, and wake their long-polls. `error` may name `{op}`
    and `{waited}` (whole seconds since it was accepted), filled in per record; `ttl` 0 keeps each record's own.
    Answers the positions in `request_ids` of those failed."""
    return script(scripts.FAIL_QUEUED, [key for rid in request_ids for key in (keys.future(rid), keys.blob_in(rid))],
                  [time.time(), ttl, created_before, model_id, error, category, code,
                   *[keys.done_channel(rid) for rid in request_ids]], _positions)


def _positions(reply: Any) -> list[int]:
    return [int(position) - 1 for position in reply]


def unpark(backlog: BacklogKeys, queue: str, tenant: str, request_ids: Sequence[str]) -> Call[int]:
    """Take `request_ids` out of the key's backlog (their records ended): nothing sends them later. Answers how many
    were there."""
    return script(scripts.UNPARK, [backlog.parked(queue, tenant), backlog.waiting(queue)], [tenant, *request_ids], int)
