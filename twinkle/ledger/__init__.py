"""The ledger: a future's lifecycle in Redis, owned in one place.

Every state a future record moves through (submitted, begun, finished, failed while queued or pending, adopted
into a restarted broker or failed as lost), every Lua script that moves it (`scripts`), and every read of where its
broker message is, kombu's unacked entries included (`messages`), are described once, as calls
(`call.Call`: a script or commands, and how to decode the reply) built by plain functions (`lifecycle`, `queued`,
`saves`, `messages`). Two thin faces run them: `SyncLedger` on a blocking client (pool workers, the launcher, the
hang watch, the queue-timeout sweep) and `AsyncLedger` on an asyncio client (the API).
"""

from twinkle.ledger.async_face import AsyncLedger
from twinkle.ledger.sync_face import SyncLedger

__all__ = ["AsyncLedger", "SyncLedger"]
