"""LoRA slots as a cache: adapters beyond a replica's slots wait in host memory or on disk, not in an error.

A replica holds at most `slots` adapters on its device. When an op needs an adapter that is not there (a
new one, or one paged out earlier), the least recently used resident adapter is paged out: the backend
hands over everything it holds for it (weights, optimizer moments and step, accumulated gradients, random
stream) as a `PagedAdapter`, and frees its slot. Paged adapters stay in host memory up to the host budget;
past it the least recently used of them are written to disk, up to the disk budget. Paging back in gives
the backend the same objects (or their unpickled copies), so training continues bit-identically.

Only when both budgets are full does making room fail (LimitExceeded): the pager then puts the adapter it
was paging out straight back, so nothing is lost. A budget of 0 turns its tier off; both 0 is the old
hard wall of `slots` adapters.

A model pool runs one op at a time, so the adapter an op needs is never evicted to make room for itself;
every other resident adapter is idle. The backend calls `use` at the start of every op on an adapter.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from twinkle.errors import LimitExceeded

log = logging.getLogger("twinkle.paging")
MIB = 1024 * 1024
DIR_PREFIX = "twinkle-paged-"


@dataclass
class PagedAdapter:
    """What a backend needs to put an adapter back exactly as it was, and its size in bytes."""

    state: Any
    nbytes: int


class Pageable(Protocol):
    """A backend whose adapters can leave their slot and come back."""

    def page_out(self, adapter_id: str) -> PagedAdapter:
        """Take the resident adapter off the device (its slot is free afterwards) and return its state."""

    def page_in(self, adapter_id: str, paged: PagedAdapter) -> None:
        """Put a paged-out adapter back into a free slot, exactly as it was."""


@dataclass(frozen=True)
class PagingBudget:
    """Where adapters go when they leave their slot: host memory first, then disk (0 bytes = tier off)."""

    host_bytes: int = 4096 * MIB
    disk_bytes: int = 32768 * MIB
    directory: str | None = None  # None: the system temp dir

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0


@dataclass
class PagingStats:
    """Counters since the replica started; `bytes_paged_in / page_ins` is the cost of one page-in."""

    page_outs: int = 0
    page_ins: int = 0
    page_ins_from_disk: int = 0
    bytes_paged_out: int = 0
    bytes_paged_in: int = 0
    bytes_written_to_disk: int = 0
    bytes_read_from_disk: int = 0
    seconds_paging: float = 0.0
    resident: int = 0
    in_host: int = 0
    on_disk: int = 0

    def as_dict(self) -> dict[str, float]:
        return {name: float(value) for name, value in self.__dict__.items()}


@dataclass
class _DiskPage:
    path: Path
    nbytes: int  # the adapter's in-memory size (what the host budget would count)
    file_bytes: int


@dataclass
class AdapterPager:
    """The residency of one replica's adapters: which sit in slots, in host memory, on disk (LRU order)."""

    backend: Pageable
    slots: int
    budget: PagingBudget = field(default_factory=PagingBudget)
    stats: PagingStats = field(default_factory=PagingStats)

    def __post_init__(self) -> None:
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._host: OrderedDict[str, PagedAdapter] = OrderedDict()
        self._disk: OrderedDict[str, _DiskPage] = OrderedDict()
        self._host_bytes = 0
        self._disk_bytes = 0
        self._directory: Path | None = None

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._resident or adapter_id in self._host or adapter_id in self._disk

    def __len__(self) -> int:
        return len(self._resident) + len(self._host) + len(self._disk)

    def is_resident(self, adapter_id: str) -> bool:
        return adapter_id in self._resident

    def resident_ids(self) -> list[str]:
        return list(self._resident)

    def paged_ids(self) -> list[str]:
        return [*self._host, *self._disk]

    def admit(self, adapter_id: str) -> None:
        """Free a slot for a new adapter; call `added` once the backend created it there."""
        self._make_room(keep={adapter_id})

    def added(self, adapter_id: str) -> None:
        self._resident[adapter_id] = None
        self._count()

    def use(self, adapter_id: str, *, together: Collection[str] = ()) -> None:
        """Make the adapter resident (paging it in if needed) and most recently used; unknown ids pass.
        Adapters in `together` are not paged out to make room for it."""
        if adapter_id in self._resident:
            self._resident.move_to_end(adapter_id)
            return
        if adapter_id not in self._host and adapter_id not in self._disk:
            return  # the backend reports it unknown in its own words
        self._make_room(keep={adapter_id, *together})
        started = time.perf_counter()
        paged = self._host.get(adapter_id)
        page = self._disk.get(adapter_id)
        if paged is None:
            assert page is not None
            with page.path.open("rb") as file:
                paged = PagedAdapter(pickle.load(file), page.nbytes)
        self.backend.page_in(adapter_id, paged)
        # only once it is back: a failed page-in leaves the adapter where it was
        if page is not None:
            del self._disk[adapter_id]
            self._disk_bytes -= page.file_bytes
            page.path.unlink(missing_ok=True)
            self.stats.page_ins_from_disk += 1
            self.stats.bytes_read_from_disk += page.file_bytes
        else:
            del self._host[adapter_id]
            self._host_bytes -= paged.nbytes
        self._resident[adapter_id] = None
        self.stats.page_ins += 1
        self.stats.bytes_paged_in += paged.nbytes
        self.stats.seconds_paging += time.perf_counter() - started
        self._count()

    def use_all(self, adapter_ids: Collection[str]) -> None:
        """Make several adapters resident at once (one op running them together)."""
        wanted = set(adapter_ids)
        if len(wanted) > self.slots:
            raise self._full(f"one call needs {len(wanted)} adapters at once")
        for adapter_id in adapter_ids:
            self.use(adapter_id, together=wanted)

    def forget(self, adapter_id: str) -> bool:
        """Drop the adapter's paged state; True when it was resident (the backend then removes it)."""
        if adapter_id in self._host:
            self._host_bytes -= self._host.pop(adapter_id).nbytes
        page = self._disk.pop(adapter_id, None)
        if page is not None:
            self._disk_bytes -= page.file_bytes
            page.path.unlink(missing_ok=True)
        resident = self._resident.pop(adapter_id, "absent") is None
        self._count()
        return resident

    def close(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    # -- making room ---------------------------------------------------------------------------

    def _make_room(self, keep: set[str]) -> None:
        while len(self._resident) >= self.slots:
            victim = next((other for other in self._resident if other not in keep), None)
            if victim is None or not self.budget.enabled:
                raise self._full(
                    "paging is off (adapter_config.page_host_mb and page_disk_mb are 0)"
                    if victim is not None else "each holds an adapter with an op in flight"
                )
            started = time.perf_counter()
            paged = self.backend.page_out(victim)
            del self._resident[victim]
            try:
                self._store(victim, paged)
            except LimitExceeded:
                self.backend.page_in(victim, paged)  # nowhere to keep it: it goes back, nothing is lost
                self._resident[victim] = None
                self._resident.move_to_end(victim, last=False)
                raise
            self.stats.page_outs += 1
            self.stats.bytes_paged_out += paged.nbytes
            self.stats.seconds_paging += time.perf_counter() - started
            log.debug("paged out adapter %s (%d bytes)", victim, paged.nbytes)

    def _store(self, adapter_id: str, paged: PagedAdapter) -> None:
        self._host[adapter_id] = paged
        self._host_bytes += paged.nbytes
        while self._host_bytes > self.budget.host_bytes and self._host:
            oldest, state = next(iter(self._host.items()))
            if not self._spill(oldest, state):
                break
        if adapter_id in self._host and self._host_bytes > self.budget.host_bytes:
            del self._host[adapter_id]
            self._host_bytes -= paged.nbytes
            host, disk = self.budget.host_bytes // MIB, self.budget.disk_bytes // MIB
            raise self._full(f"the storage for paged-out adapters is full ({host} MiB host memory, "
                             f"{disk} MiB disk)")
        self._count()

    def _spill(self, adapter_id: str, paged: PagedAdapter) -> bool:
        """Write a host-memory adapter to disk; False when the disk budget has no room for it."""
        if self.budget.disk_bytes <= 0 or self._disk_bytes + paged.nbytes > self.budget.disk_bytes:
            return False
        path = self._dir() / f"{uuid.uuid4().hex}.pkl"
        partial = path.with_suffix(".partial")
        with partial.open("wb") as file:
            pickle.dump(paged.state, file, protocol=pickle.HIGHEST_PROTOCOL)
        partial.rename(path)
        file_bytes = path.stat().st_size
        del self._host[adapter_id]
        self._host_bytes -= paged.nbytes
        self._disk[adapter_id] = _DiskPage(path, paged.nbytes, file_bytes)
        self._disk_bytes += file_bytes
        self.stats.bytes_written_to_disk += file_bytes
        return True

    def _dir(self) -> Path:
        if self._directory is None:
            parent = Path(self.budget.directory or tempfile.gettempdir()).expanduser()
            parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_dirs(parent)
            self._directory = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=parent))
            weakref.finalize(self, shutil.rmtree, self._directory, True)
        return self._directory

    def _full(self, why: str) -> LimitExceeded:
        return LimitExceeded(
            f"All {self.slots} LoRA slots of this replica are in use and {why}.",
            hint="Finish sessions you no longer need (ServiceClient.close, or unload_model), or retry later; "
                 "the operator can raise adapter_config.max_loras, page_host_mb or page_disk_mb.",
            max_loras=self.slots,
        )

    def _count(self) -> None:
        self.stats.resident = len(self._resident)
        self.stats.in_host = len(self._host)
        self.stats.on_disk = len(self._disk)


def _remove_stale_dirs(parent: Path) -> None:
    """Page files of a process that died are nobody's: its adapters went with it (crash recovery restores
    them from checkpoints), so their disk space is freed here."""
    for path in parent.glob(f"{DIR_PREFIX}*"):
        pid = path.name[len(DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
