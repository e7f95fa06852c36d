"""What a pool reads for an op, read in the round trip that records the op's message as delivered.

Before it runs an op a pool reads the future record, its payload and the model the message names
(`twinkle.ledger.lifecycle.read_for_run`). The consumer already sends one command to Redis per message (it records
the delivery, workers/op_consumer.py or workers/handover.py), so it sends the read in the same pipeline and keeps
the answer here for the op, which takes it instead of a round trip of its own.

Every model pool on its own consumer uses this (fair share takes each op's tenant and cost from the read,
workers/fair_turns.py), and under Celery's consumer a model pool with clock cycles and a sampler pool. An op held
to wait for its turn re-checks at its turn what may have changed since (`begin` refuses a future that ended
meanwhile). A model pool on Celery's consumer without clock cycles (a watched one), which runs one op at a time
with the next message reserved, reads when the op runs.
"""

from __future__ import annotations

import threading
from typing import Any

from twinkle.keys import Keys
from twinkle.ledger import lifecycle
from twinkle.ledger.call import Call
from twinkle.ledger.lifecycle import RunInputs
from twinkle.recent import Recent
from twinkle.task_message import op_ids

# Far above a pool's window of held ops: reads that no thread took (a message Celery refused) age out here.
LIMIT = 4096


class Prereads:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._kept: Recent[str, tuple[str, RunInputs]] = Recent(LIMIT)
        self._lock = threading.Lock()

    def read_for(self, message: Any) -> tuple[str, str, Call[RunInputs]] | None:
        """The request id, the model id and the read for a Twinkle task's message; None for any other message.
        kombu keeps the decoded body, so Celery does not decode it again."""
        ids = op_ids(message)
        if ids is None:
            return None
        request_id, model_id = ids
        return request_id, model_id, self.read(request_id, model_id)

    def read(self, request_id: str, model_id: str) -> Call[RunInputs]:
        """The read an op needs before it runs (`lifecycle.read_for_run`), to send with its delivery record."""
        return lifecycle.read_for_run(self.keys, request_id, model_id)

    def keep(self, request_id: str, model_id: str, inputs: RunInputs) -> None:
        with self._lock:
            self._kept.put(request_id, (model_id, inputs))

    def peek(self, request_id: str, model_id: str) -> RunInputs | None:
        """The read kept for this delivery of the op, left for its `take`; None when there is none."""
        with self._lock:
            kept = self._kept.get(request_id)
        return kept[1] if kept is not None and kept[0] == model_id else None

    def take(self, request_id: str, model_id: str) -> RunInputs | None:
        """The read kept for this delivery of the op, once; None when there is none for the same model."""
        with self._lock:
            kept = self._kept.pop(request_id)
        return kept[1] if kept is not None and kept[0] == model_id else None

    def __len__(self) -> int:
        return len(self._kept)
