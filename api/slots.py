"""Whether a queued op waits for a LoRA slot: what `try_again` reports as `paused_capacity`.

A model replica holds `max_loras` adapters in its slots and pages the others out (backends.paging). A
queued op whose adapter is paged out (or not created yet) while every slot holds another adapter waits
for the ops ahead of it; its turn pages it back in. The op never fails for that: it queues.
"""

from __future__ import annotations

from api.context import ApiContext
from twinkle.futures import FutureRecord, FutureStatus


async def waiting_for_slot(ctx: ApiContext, record: FutureRecord) -> str | None:
    """Why the queued op waits for a slot, or None when it does not."""
    slots = ctx.catalog.slots(record.queue)
    if record.state is not FutureStatus.QUEUED or not record.model_id or slots <= 0:
        return None
    resident, used = await ctx.pools.slot_use(record.queue, record.model_id)
    if resident or used < slots:
        return None
    return (f"all {slots} LoRA slots of {record.queue} hold other adapters; this model is paged in "
            "when its turn comes")
