"""TwinkleFuture: the pending result of a server request, resolved by long-polling `/retrieve_future`.

Every compute call answers at once with a request id; the result is fetched by POSTing that id to
`/retrieve_future`, which holds the request for up to ~30 s and then answers with the result, with
`{"type": "try_again", ...}` (poll again) or with `{"error", "category"}` (the request failed).

Polling starts as soon as a future exists, on a few background threads shared by the client, so
`done()` tells the truth without blocking and several submitted calls resolve while the caller does
other work. The threads are daemons: an interpreter that exits never waits for a pending poll.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import ValidationError
from tqdm import tqdm

from twinkle_client.errors import FutureTimeout, RequestFailed, TwinkleClientError
from twinkle_client.transport import Transport

T = TypeVar("T")
log = logging.getLogger("twinkle_client")

QUEUE_NOTICE_SECONDS = 15.0
"""How long a request may wait before a progress line shows what it is waiting for."""

SHORT_POLL_SECONDS = 1.0
"""A try_again answered faster than this means the server did not hold the poll; back off then."""

SHORT_POLL_BACKOFF_MAX = 2.0


class TwinkleFuture(Generic[T]):
    """The result of a request that is running on the server; `result()` waits for it."""

    def __init__(
        self, inner: concurrent.futures.Future[T], request_id: str | None = None, label: str = ""
    ) -> None:
        self._inner = inner
        self._request_id = request_id
        self._label = label

    @property
    def request_id(self) -> str | None:
        """The server's id of the request (None for a future that chains several requests)."""
        return self._request_id

    def result(self, timeout: float | None = None) -> T:
        """The result, waiting at most `timeout` seconds (None waits as long as it takes).

        Raises RequestFailed when the request failed on the server, FutureTimeout when the time runs out
        (the request keeps running; call result() again to keep waiting).
        """
        try:
            return self._inner.result(timeout)
        except concurrent.futures.TimeoutError:
            raise FutureTimeout(
                f"{self._describe()} did not finish within {timeout:g} s. It is still running on the server; "
                "call result() again to keep waiting."
            ) from None

    def done(self) -> bool:
        """Whether the result (or the failure) has arrived; never blocks."""
        return self._inner.done()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"TwinkleFuture({self._describe()}, {state})"

    def _describe(self) -> str:
        name = self._label or "request"
        return f"{name} {self._request_id}" if self._request_id else name


class FuturePoller:
    """Resolves futures on a fixed set of daemon threads (started on first use)."""

    def __init__(self, transport: Transport, *, workers: int = 16, poll_timeout: float = 75.0) -> None:
        self._transport = transport
        self._workers = workers
        self._poll_timeout = poll_timeout
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def track(
        self, request_id: str, parse: Callable[[dict[str, Any]], T], label: str, show_queue: bool = True
    ) -> TwinkleFuture[T]:
        """A future for `request_id` whose result is `parse(reply)`."""
        return self.run(lambda: self._retrieve(request_id, parse, label, show_queue), label, request_id)

    def run(self, work: Callable[[], T], label: str, request_id: str | None = None) -> TwinkleFuture[T]:
        """A future for the value of `work()`, computed on a poller thread (for calls that chain requests)."""
        inner: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if not inner.set_running_or_notify_cancel():
                return
            try:
                inner.set_result(work())
            except BaseException as error:  # noqa: BLE001 - handed to whoever calls result()
                inner.set_exception(error)

        with self._lock:
            if self._closed:
                raise TwinkleClientError(
                    "This Twinkle client is closed; create a new one with init_twinkle_client()."
                )
            self._start_threads()
            self._jobs.put(job)
        return TwinkleFuture(inner, request_id, label)

    def wait(self, request_id: str, parse: Callable[[dict[str, Any]], T], label: str) -> T:
        """The result of `request_id`, polled on the calling thread (for work that already runs on a poller
        thread: waiting on another pooled future there could starve the pool)."""
        return self._retrieve(request_id, parse, label, show_queue=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)

    def _start_threads(self) -> None:
        while len(self._threads) < self._workers:
            thread = threading.Thread(
                target=self._work, name=f"twinkle-future-{len(self._threads)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def _retrieve(
        self, request_id: str, parse: Callable[[dict[str, Any]], T], label: str, show_queue: bool
    ) -> T:
        started = time.monotonic()
        notice: QueueNotice | None = None
        quick_replies = 0
        try:
            while True:
                asked = time.monotonic()
                reply = self._transport.request(
                    "POST",
                    "/retrieve_future",
                    json={"request_id": request_id},
                    idempotent=True,
                    timeout=self._poll_timeout,
                )
                if not isinstance(reply, dict):
                    raise TwinkleClientError(
                        f"retrieve_future for {request_id} answered {type(reply).__name__}."
                    )
                if reply.get("type") == "try_again":
                    if show_queue and time.monotonic() - started >= QUEUE_NOTICE_SECONDS:
                        notice = notice or QueueNotice(label, request_id)
                        notice.update(reply)
                    if time.monotonic() - asked < SHORT_POLL_SECONDS:
                        # The server answered without holding the poll (a paused queue, an old server):
                        # polling again at once would spin, so wait a little longer each time.
                        time.sleep(min(SHORT_POLL_BACKOFF_MAX, 0.05 * 2**quick_replies))
                        quick_replies += 1
                    else:
                        quick_replies = 0
                    continue
                if "error" in reply and "category" in reply:
                    raise RequestFailed(
                        str(reply.get("category") or "server"),
                        str(reply["error"]),
                        request_id,
                        reply.get("code"),
                    )
                try:
                    return parse(reply)
                except (KeyError, TypeError, ValueError, ValidationError) as error:
                    raise TwinkleClientError(
                        f"The result of {label} {request_id} does not have the expected shape ({error}). "
                        "Are the client and server versions compatible?"
                    ) from None
        finally:
            if notice is not None:
                notice.close()


class QueueNotice:
    """One stderr line saying what a slow request waits for (the queue and how many are ahead)."""

    def __init__(self, label: str, request_id: str) -> None:
        self._prefix = f"{label} {request_id[-8:]}"
        self._bar = tqdm(total=None, file=sys.stderr, leave=False, bar_format="{desc} [{elapsed}]")

    def update(self, reply: dict[str, Any]) -> None:
        reason = (
            reply.get("queue_state_reason") or reply.get("status") or reply.get("queue_state") or "waiting"
        )
        state = reply.get("queue_state")
        if state and state != "active":
            reason = f"{reason} ({state})"
        self._bar.set_description_str(f"{self._prefix}: {reason}", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
