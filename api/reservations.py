"""The API's side of pools held by full-parameter runs (twinkle.pool_reservation): refusing ops where the pool
refuses, saying why a queued op waits, and renewing a run's lease with its session's heartbeat."""

from __future__ import annotations

import time
from typing import Any

from twinkle.futures import FutureRecord, FutureStatus
from twinkle.keys import Keys
from twinkle.pool_reservation import Reservation, renew


async def held(r: Any, keys: Keys, queue: str) -> Reservation | None:
    """The reservation of `queue` while it holds (None: free, or over and about to end)."""
    reservation = Reservation.from_hash(await r.hgetall(keys.pool_reservation(queue)))
    return reservation if reservation is not None and not reservation.over() else None


async def refuse_while_held(r: Any, keys: Keys, queue: str, model_id: str) -> None:
    """Raise PoolReserved for an op of any run but the holder on a pool that refuses while reserved."""
    reservation = await held(r, keys, queue)
    if reservation is not None and reservation.holder != model_id:
        raise reservation.refusal(queue)


async def waiting_reason(r: Any, keys: Keys, record: FutureRecord) -> str | None:
    """Why a queued op of another run waits for its pool (None: it does not wait for a reservation)."""
    if record.state is not FutureStatus.QUEUED:
        return None
    reservation = await held(r, keys, record.queue)
    if reservation is None or reservation.holder == record.model_id:
        return None
    place = await r.lpos(keys.reservation_parked_ids(record.queue), record.request_id)
    until = time.strftime("%H:%M:%S UTC", time.gmtime(reservation.until))
    where = f"{place} parked ahead of it" if place is not None else "it has not reached the pool yet"
    return (f"{record.queue} is reserved by a full-parameter run until {until} (renewed while that run is active); "
            f"{where}")


async def renew_for_session(r: Any, keys: Keys, queues: list[str], session_id: str) -> None:
    """A session's heartbeat keeps its full-parameter run's hold of a pool."""
    for queue in queues:
        reservation = Reservation.from_hash(await r.hgetall(keys.pool_reservation(queue)))
        if reservation is not None and reservation.session_id == session_id:
            await renew(r, keys, queue, reservation.holder)
