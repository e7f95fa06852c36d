"""The futures this API process submitted, and what their done messages said: a poll of one needs no read.

The SDK polls every op it submits at once, on the API process that accepted it. That process's hub has been
subscribed to every done message since before the submit (api/hub.py), so until one arrives the future has not
ended, and a parked poll of it can wait without reading the record first; when the done message carried the
result (twinkle.ledger.lifecycle.finish), the poll answers it without any read.

This holds only while the subscription has held since the submit: each confirmed (re)subscription starts a new
epoch, and a future submitted in an earlier one is read as before, as is one whose done message carried only its
status (a failure, or a large result), one submitted by another process or for another caller, and one forgotten
to keep this bounded. The hub's periodic re-read still covers every parked poll.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from twinkle.futures import FutureRecord

LIMIT = 16384  # futures remembered; the oldest are forgotten (their polls read)
ENDED_LIMIT = 4096  # done messages of futures not (yet) remembered, for a submit answered after its op ended


@dataclass(slots=True)
class Submitted:
    record: FutureRecord  # as submitted: queued
    epoch: int
    ended: bool = False
    result: bytes | None = None  # what its done message carried


class SubmittedHere:
    def __init__(self) -> None:
        self.epoch = 0
        self.listening = False  # the hub's subscription is confirmed and has not dropped since
        self._futures: OrderedDict[str, Submitted] = OrderedDict()
        self._ended_unknown: OrderedDict[str, None] = OrderedDict()

    def subscribed(self) -> None:
        """The hub's subscription was (re)confirmed: done messages sent before may never have arrived."""
        self.epoch += 1
        self.listening = True

    def unsubscribed(self) -> None:
        self.listening = False

    def add(self, record: FutureRecord) -> None:
        """A future this process has just submitted."""
        if not self.listening:
            return
        ended = record.request_id in self._ended_unknown  # its op ended before the submit's answer was read
        self._ended_unknown.pop(record.request_id, None)
        self._futures[record.request_id] = Submitted(record, self.epoch, ended=ended)
        while len(self._futures) > LIMIT:
            self._futures.popitem(last=False)

    def ended(self, request_id: str, result: bytes | None) -> None:
        """Its done message arrived, carrying `result` or only the status."""
        known = self._futures.get(request_id)
        if known is not None:
            known.ended, known.result = True, result
            return
        self._ended_unknown[request_id] = None
        while len(self._ended_unknown) > ENDED_LIMIT:
            self._ended_unknown.popitem(last=False)

    def known(self, request_id: str, owner: str) -> Submitted | None:
        """What the done messages tell of `owner`'s future, when they tell all of it; None: read the record."""
        known = self._futures.get(request_id)
        if known is None or known.record.owner != owner or known.epoch != self.epoch or not self.listening:
            return None
        return known

    def forget(self, request_id: str) -> None:
        self._futures.pop(request_id, None)
