"""The pool worker's Redis transport: a message is never only in the memory of a worker that has not recorded it.

kombu's Redis transport takes a message with BRPOP, and only then writes it to the `unacked` hash. A broker
killed between the two (a few milliseconds while ops flow; measured: 3 of 4 runs of ten restarts lost one op)
has already persisted the pop but not the hash: the message is gone, and its future ends `request_lost`.

Here the pop is BLMOVE into a handover list of the queue's own (`twinkle.ledger.messages.handover_key`), which Redis
persists atomically with the pop, and one script then moves the message from that list into `unacked`. So a
message is always in the queue, the handover list or `unacked`. A channel puts whatever the handover list holds
back at the head of the queue before its first pop (what a connection lost mid-handover left there; the list
belongs to this queue's single consumer, twinkle/pool_lease.py), and the launcher's `restore_unacked` does the
same before it starts a pool.

Only a channel consuming exactly one queue without a global key prefix works this way (a pool worker);
anything else gets kombu's own BRPOP. Priorities are not used by Twinkle: the handover pops the queue's base
list only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from twinkle.ledger import SyncLedger, messages
from workers.prereads import Prereads

T = TypeVar("T")

# Delivery tags whose message the op's own finish acknowledged in Redis (twinkle.ledger.lifecycle.finish): the
# consumer's ack that follows keeps only kombu's in-memory bookkeeping, saving a round trip per op.
ACKED_BY_FINISH: set[str] = set()
# Set by a pool whose ops each get a thread at once: each delivery's read goes with its record (workers/prereads.py).
PREREADS: Prereads | None = None
# Pauses between tries of a delivery's record (and its read), which the broker may have run before the connection
# broke: the script is idempotent, so it is sent again until the broker is back (a restart takes about a second).
# Given up, a recorded message would wait out the orphan sweep (workers/orphans.py, 5-7 s), the op with it.
RECORD_PAUSES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)


def retrying_record(record: Callable[[], T]) -> T:
    """Send a delivery's record (idempotent) until the broker answers, pausing `RECORD_PAUSES` between tries; the
    last failure propagates: the message then waits in the handover list or, recorded, for the orphan sweep."""
    for pause in RECORD_PAUSES:
        try:
            return record()
        except (redis.ConnectionError, redis.TimeoutError):
            time.sleep(pause)
    return record()


class HandoverQoS(kombu_redis.QoS):  # type: ignore[misc]
    def ack(self, delivery_tag: str) -> None:
        try:
            ACKED_BY_FINISH.remove(delivery_tag)
        except KeyError:
            super().ack(delivery_tag)
        else:
            virtual.QoS.ack(self, delivery_tag)

    def in_hand(self) -> int:
        """Messages delivered and not yet acked, as `can_consume` counts them against the prefetch limit. Read off
        the consumer's thread it may count one message twice while the consumer flushes its acks, never too few."""
        return len(self._delivered) - len(self._dirty)

    def append(self, message: Any, delivery_tag: str) -> None:
        handing = self.channel.handing
        if handing is None:
            super().append(message, delivery_tag)
            return
        queue, item = handing
        delivery = message.delivery_info
        entry = messages.entry(item, delivery["exchange"], delivery["routing_key"])
        recorded = messages.record_delivery(queue, delivery_tag, entry, item, index_key=self.unacked_index_key,
                                            unacked_key=self.unacked_key)
        prereads = PREREADS
        read = prereads.read_for(message) if prereads is not None else None

        def record() -> None:
            with self.channel.conn_or_acquire() as client:
                if read is None:
                    self.channel.ledger(client).run(recorded)
                    return
                assert prereads is not None, "a read comes from the prereads"
                request_id, model_id, call = read
                _, inputs = self.channel.ledger(client).run_then(recorded, call)
                if not isinstance(inputs, Exception):  # else the op's thread reads for itself
                    prereads.keep(request_id, model_id, inputs)

        retrying_record(record)
        virtual.QoS.append(self, message, delivery_tag)  # kombu's in-memory bookkeeping, without its own write


class HandoverChannel(kombu_redis.Channel):  # type: ignore[misc]
    QoS = HandoverQoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._sync_client: Any = None
        self._sync_client_pool: Any = None
        self._ledger: SyncLedger | None = None  # on the client that records deliveries
        super().__init__(*args, **kwargs)
        self.handing: tuple[str, bytes] | None = None  # the message between its pop and its unacked entry
        self._popping: str | None = None  # the queue of the BLMOVE in flight
        self._returned = False  # what a lost connection left in the handover list is back in the queue

    def _create_client(self, asynchronous: bool = False) -> Any:
        """kombu builds a new Redis client for every synchronous use (recording a delivery, acking it), and
        redis-py's constructor fills a table of some 170 response callbacks each time: a fifth of a pool worker's
        CPU per op. A client is only its connection pool and that table, and is thread-safe, so one per pool
        serves them all (a reconnect makes a new pool, and with it a new client)."""
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        if self._sync_client is None or self._sync_client_pool is not pool:
            self._sync_client, self._sync_client_pool = super()._create_client(), pool
        return self._sync_client

    def ledger(self, client: Any) -> SyncLedger:
        """The ledger on `client`, kept while the client is (its scripts are registered once)."""
        if self._ledger is None or self._ledger.r is not client:
            self._ledger = SyncLedger(client)
        return self._ledger

    def _handover_queue(self) -> str | None:
        if self.global_keyprefix or len(self.active_queues) != 1:
            return None
        return str(next(iter(self.active_queues)))

    def _brpop_start(self, timeout: float | None = None) -> None:
        queue = self._handover_queue()
        if queue is None:
            super()._brpop_start(timeout)
            return
        if timeout is None:
            timeout = self.brpop_timeout
        client = self.client
        if not self._returned:
            SyncLedger(client).run(messages.return_handover(queue))
            self._returned = True
        self._in_poll = client.connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]
        self._popping = queue
        client.connection.send_command("BLMOVE", queue, messages.handover_key(queue), "RIGHT", "LEFT", timeout or 0)

    def _brpop_read(self, **options: Any) -> bool:
        queue = self._popping
        if queue is None:
            return bool(super()._brpop_read(**options))
        try:
            try:
                item = self.client.parse_response(self.client.connection, "BLMOVE", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                self._returned = False
                raise
            if not item:
                raise kombu_redis.Empty()
            self.handing = (queue, item)
            try:
                self.connection._deliver(loads(bytes_to_str(item)), queue)
            finally:
                self.handing = None
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._popping = None
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()


class HandoverTransport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = HandoverChannel
