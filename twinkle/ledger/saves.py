"""Each API key's outstanding checkpoint saves (queued or running), counted against its cap (api/checkpoint_writes.py).

A key's saves are a sorted set of request ids; the reservation drops the ids whose futures ended (or never appeared
within `grace` seconds of their reservation) before it counts, so nothing has to decrement anything when an op ends.
"""

from __future__ import annotations

from twinkle.keys import Keys
from twinkle.ledger import scripts
from twinkle.ledger.call import Call, commands, script


def reserve_save(keys: Keys, owner: str, request_id: str, *, limit: int, grace: int, ttl: int) -> Call[int | None]:
    """Count `request_id` among `owner`'s outstanding saves unless `limit` are already: None when reserved, else how
    many are outstanding."""
    return script(scripts.RESERVE_SAVE, [keys.checkpoint_writes(owner)],
                  [keys.future(""), request_id, limit, grace, ttl], _reserved)


def _reserved(reply: int) -> int | None:
    outstanding = int(reply)
    return None if outstanding < 0 else outstanding


def release_save(keys: Keys, owner: str, request_id: str) -> Call[None]:
    """Forget a reservation whose save was never submitted."""
    return commands(("ZREM", keys.checkpoint_writes(owner), request_id), decode=lambda _: None)
