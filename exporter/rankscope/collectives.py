"""One view of every collective this rank takes part in: counts, time, and what is in flight.

Two sources, each for what it does best (docs/collectives.md):

- **A post hook on each gloo process group** (``ProcessGroup.register_post_hook``, which sees every collective
  the group issues, functional ones and send/recv included) counts each collective as it is issued and times
  it to completion from its work's future, on gloo's thread; a blocking reduce-scatter (a composite work with
  no future) to the return of the wait torch makes right after issuing it. On gloo (torch 2.14.1) the Flight
  Recorder cannot time collectives (it records only their creation: ``time_discovered_*`` stay 0, no
  ``duration_ms``) and does not record send/recv at all. When a group is hooked, the recorder is read once for
  what the group started before (the baseline); after that a scrape of a gloo-only job never reads the recorder.
- **torch's Flight Recorder** (FR) lists every collective of every process group with a record id, its group,
  op name (``nccl:_allgather_base``) and whether it has finished (``retired``). It is read from the metrics
  thread at scrape time while a group is not hooked (NCCL groups; any group before the step end that hooks
  it): counts from each group's sequence ids, the oldest NCCL collective still in flight, and NCCL's own
  ``duration_ms`` (recorded from CUDA events by NCCL's watchdog thread when ``TORCH_NCCL_ENABLE_TIMING=1``,
  which `enable_collective_view` sets): no host-device synchronisation on the training thread. (Unmeasured
  here: no GPU on this machine.) A dump copies and unpickles the whole ring, about a millisecond even when it
  holds a few records (benchmarks/README.md), which is why gloo-only jobs avoid it on every scrape.

``rankscope_collectives_total{dim}`` (started by this rank: the lag signal) and the collective in flight (the
progress tracker's 'collective' phase) are both kept up by threads a blocked training thread cannot freeze.

`TORCH_FR_BUFFER_SIZE` is read once, when torch's Flight Recorder is first used: the first process group's
creation (``init_process_group``), or an earlier dump. Later changes have no effect. torch 2.14.1 keeps 2000
records by default (gloo included); 0 switches it off. Call `enable_collective_view()` before
``init_process_group`` to make sure it is on.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DIMS",
    "KINDS",
    "CollectiveView",
    "InFlight",
    "dim_of_mesh_name",
    "enable_collective_view",
    "kind_of",
]

logger = logging.getLogger("rankscope")

#: The bounded `kind` label.
KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "barrier", "other")
#: The bounded `dim` label.
DIMS: tuple[str, ...] = ("data", "tensor", "pipeline", "context", "other")

#: Records kept by the Flight Recorder when the user has not chosen (torch 2.14.1's own default).
DEFAULT_BUFFER_SIZE = 2000

# Substrings of an op name -> kind, first match wins (reduce_scatter before all_reduce: "reduce" is in both).
_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    ("reduce_scatter", "reduce_scatter"),
    ("reducescatter", "reduce_scatter"),
    ("_reduce_scatter_base", "reduce_scatter"),
    ("all_gather", "all_gather"),
    ("allgather", "all_gather"),
    ("all_reduce", "all_reduce"),
    ("allreduce", "all_reduce"),
    ("broadcast", "broadcast"),
    ("send", "send_recv"),
    ("recv", "send_recv"),
    ("barrier", "barrier"),
)

# DeviceMesh dimension names as torchtitan, Lightning and accelerate spell them -> dim.
_DIM_NAMES: dict[str, str] = {
    "dp": "data", "data": "data", "dp_shard": "data", "dp_replicate": "data", "shard": "data",
    "replicate": "data", "fsdp": "data", "ddp": "data", "hsdp": "data", "dp_cp": "data", "dp_shard_cp": "data",
    "tp": "tensor", "tensor": "tensor", "model": "tensor", "ep": "tensor",
    "pp": "pipeline", "pipeline": "pipeline", "pipe": "pipeline", "stage": "pipeline",
    "cp": "context", "context": "context", "sp": "context", "seq": "context",
}  # fmt: skip


def enable_collective_view() -> bool:
    """Make sure torch's Flight Recorder records collectives; call before ``init_process_group``.

    Sets ``TORCH_FR_BUFFER_SIZE`` (to 2000) unless the user chose a size, and ``TORCH_NCCL_ENABLE_TIMING=1``
    unless set (NCCL then records each collective's duration from CUDA events, read by its watchdog thread;
    without it FR has no durations for NCCL). Returns whether the view can be on: False when a process group
    already exists with the recorder off (torch read the size then; it is not read again)."""
    os.environ.setdefault(
        "TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", str(DEFAULT_BUFFER_SIZE))
    )
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    return recorder_state()[0]


def recorder_state() -> tuple[bool, str]:
    """(whether the Flight Recorder records, why not if it does not), from the environment and torch."""
    try:
        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]  # noqa: F401
    except Exception as exc:  # a torch without distributed or without FR
        return False, f"torch's Flight Recorder is not available ({exc!r})"
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if size is not None and size.strip() in ("0", ""):
        if dist.is_available() and dist.is_initialized():
            return False, "TORCH_FR_BUFFER_SIZE=0 when the process group was created (torch reads it only then)"
        return False, "TORCH_FR_BUFFER_SIZE=0"
    return True, ""


def kind_of(op_name: str) -> str:
    """The bounded kind of a Flight Recorder op name (``gloo:all_gather``, ``nccl:_allgather_base``) or a
    hook's op name (``ALLGATHER``)."""
    name = op_name.lower()
    for pattern, kind in _KIND_PATTERNS:
        if pattern in name:
            return kind
    return "other"


def dim_of_mesh_name(name: str | None) -> str:
    """The bounded dim of a DeviceMesh dimension name (``dp_shard`` -> data, ``tp`` -> tensor, ...)."""
    return _DIM_NAMES.get((name or "").lower(), "other")


@dataclass(frozen=True)
class InFlight:
    """The oldest collective this rank started and has not finished."""

    record_id: int
    kind: str
    dim: str
    group: str
    seq: int
    started: float  # Unix seconds (FR's time_created_ns)


class CollectiveView:
    """Every collective of this rank, from the Flight Recorder and per-group completion hooks.

    Thread use: the hooks run on the training thread (post hook) and gloo's threads (completion); `read()`
    runs on the metrics thread; `take_step()` on the training thread at the step's end. The only shared
    state is guarded by one lock, held for a few additions.
    """

    def __init__(self) -> None:
        self.enabled, self.why_off = recorder_state()
        self._lock = threading.Lock()
        self._group_dim: dict[str, str] = {"0": "data"}  # process group name -> dim ("0": the default group)
        self._hook_id = next(_HOOK_IDS)
        self._hooked: dict[int, Any] = {}  # id() -> process groups with our hooks
        self._groups_seen = -1
        self._timing = True  # hooks are how gloo groups are timed
        self._nccl = False  # an NCCL group exists: per-step time would miss its collectives
        # Written by completion callbacks (gloo threads), read by the metrics thread.
        self._seconds: dict[tuple[str, str], float] = {}
        self._step_intervals: list[tuple[float, float]] = []
        self._pending: dict[int, _Pending] = {}  # issued, not seen finished; oldest first
        self._waited_items = 0  # of them, blocking composites whose end is a wait (`thread` set)
        self._untimed = 0  # collectives whose completion torch does not report (see _issued)
        # Per hooked (gloo) group: the collectives and send/recv it issued since hooked, and what it had started
        # before (FR's count at hooking, less what the hooks had counted by then). Written under `_lock`.
        self._issued_count: dict[str, int] = {}
        self._baseline: dict[str, int] = {}
        self._unhooked = True  # a process group may exist that no hook counts: the metrics thread reads FR
        self.recorder_dumps = 0  # Flight Recorder dumps so far (each copies the whole ring)
        # Read side (metrics thread only).
        self._last_record = -1
        # Per process group, the highest (collective, p2p) sequence ids seen: how many it started, however
        # many records the ring buffer dropped between two reads.
        self._seq: dict[str, tuple[int, int]] = {}
        self._fr_seconds: dict[tuple[str, str], float] = {}  # NCCL durations from FR
        self._open_nccl: dict[int, tuple[str, str]] = {}  # NCCL records not finished at the last read
        self.in_flight: InFlight | None = None
        self.read_seconds = 0.0  # cost of the latest read (benchmarks report it)
        self._read_lock = threading.Lock()

    # --- wiring -----------------------------------------------------------------------------

    def watch_mesh(self, mesh: Any) -> None:
        """Label each process group of a DeviceMesh with its dimension's dim (from its dim names)."""
        names = getattr(mesh, "mesh_dim_names", None) or ()
        for index in range(mesh.ndim):
            dim = dim_of_mesh_name(names[index] if index < len(names) else None)
            if not names and mesh.ndim == 1:
                dim = "data"  # an unnamed 1-D mesh is data parallel (fully_shard's default)
            group = mesh.get_group(index)
            self._group_dim[_group_name(group)] = dim
        self.attach_groups()

    def label_group(self, group: Any, dim: str) -> None:
        """Label one process group (e.g. a pipeline stage's) with a dim from `DIMS`."""
        if dim not in DIMS:
            raise ValueError(f"dim must be one of {', '.join(DIMS)}, got {dim!r}")
        self._group_dim[_group_name(group)] = dim
        self.attach_groups()

    def dim_of(self, group_name: str) -> str:
        return self._group_dim.get(group_name, "other")

    def attach_groups(self) -> None:
        """Hook every gloo process group not hooked yet (new groups appear when a mesh is built); cheap when
        none is new. Called at each step's end."""
        if not self.enabled or not self._timing:
            return
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return
            pg_map = dist.distributed_c10d._world.pg_map
            if len(pg_map) == self._groups_seen:
                return
            groups = list(pg_map)
            self._groups_seen = len(groups)
            counted = [name for group in groups if id(group) not in self._hooked and (name := self._hook(group))]
            if counted:
                self._take_baseline(counted)
            self._unhooked = self._nccl
        except Exception as exc:  # torch internals moved: counts and phases still come from FR
            self._timing = False
            self._unhooked = True
            logger.warning("rankscope: collective timing hooks unavailable (counts still from FR): %r", exc)

    def _take_baseline(self, names: list[str]) -> None:
        """What the newly hooked groups started before their hooks: FR's count now, less what the hooks counted
        already (they were registered first, so a collective issued in between is counted once)."""
        started = self._dump_seq()
        with self._lock:
            for name in names:
                collective, p2p = started.get(name, (0, 0))
                self._baseline[name] = collective + p2p - self._issued_count.get(name, 0)

    def close(self) -> None:
        """Remove the hooks from every process group (`attach_groups` puts them back)."""
        for group in self._hooked.values():
            with contextlib.suppress(Exception):  # a group destroyed already has nothing to remove
                group.unregister_post_hook(self._hook_id)
        self._hooked.clear()
        self._groups_seen = -1
        self._unhooked = True
        with self._lock:  # counted from FR again until hooked again (with a new baseline)
            self._issued_count.clear()
            self._baseline.clear()
            for item in self._pending.values():
                if item.thread:
                    _WAITED.pop(id(item.work), None)

    def _hook(self, group: Any) -> str | None:
        """Hook one group; its name when the hooks count it (gloo), None for NCCL (counted from FR)."""
        self._hooked[id(group)] = group
        backend = str(group.name() if callable(getattr(group, "name", None)) else "").lower()
        if "nccl" in backend:
            self._nccl = True
            return None  # NCCL: durations from FR (duration_ms), never a host callback on its futures
        name = _group_name(group)

        def post(args: Any) -> None:
            try:
                self._issued(args, name)
            except Exception as exc:  # never into the training loop: timing off, counted in the log
                self._timing = False
                logger.warning("rankscope: collective timing hook failed; timing off (counts go on): %r", exc)

        group.register_post_hook(self._hook_id, post)
        return name

    def _issued(self, args: Any, group: str) -> None:
        """A collective was issued on a hooked group (training thread): count it, time it to completion.

        This runs for every collective (DDP's buckets, FSDP2's gathers), inside the loop's backward: each
        call it makes counts, so the op's kind is looked up, not worked out again (str() of torch's op enum
        alone costs microseconds)."""
        op = args.name
        kind = _HOOK_KINDS.get(op)
        if kind is None:
            kind = _HOOK_KINDS.setdefault(op, kind_of(str(op)))  # torch's op enum: a bounded set
        with self._lock:
            self._issued_count[group] = self._issued_count.get(group, 0) + 1
        work = args.work
        if work is None or not self._timing:
            return
        now = time.perf_counter()
        if self._waited_items:
            self._drop_unwaited(threading.get_ident())  # a blocking one this thread issued before has returned
        try:
            future = work.get_future()
        except RuntimeError:
            # torch's composite works (gloo's reduce_scatter_tensor: an all-reduce, then a copy into the output
            # that wait() makes) have no future and never report completion (is_completed() stays False after
            # wait()). A blocking one (what FSDP2 issues) ends when the wait that torch makes right after
            # issuing it returns: `_watch_wait` sees that. Gloo's send/recv works have no future either and are
            # asynchronous: they report completion only once the loop has waited on them, which bounds nothing
            # (a pipeline stage computes between a recv's wait and its next op): counted above, not timed.
            if getattr(args, "async_op", True) or not _watch_wait():
                self._untimed += 1
                return
            item = _Pending(kind, self.dim_of(group), group, now, time.time(), work, threading.get_ident())
            with self._lock:
                self._pending[id(item)] = item
                self._waited_items += 1
            _WAITED[id(work)] = lambda: self._finish(item, time.perf_counter())
            return
        item = _Pending(kind, self.dim_of(group), group, now, time.time(), work)
        with self._lock:
            self._pending[id(item)] = item
        future.add_done_callback(lambda _future: self._finish(item, time.perf_counter()))

    def _drop_unwaited(self, thread: int) -> None:
        """A blocking collective this thread issued whose end no Python wait showed (torch waited in C++): the
        thread is past it, so it is not in flight; counted, not timed."""
        with self._lock:
            stale = [key for key, item in self._pending.items() if item.thread == thread]
            for key in stale:
                item = self._pending.pop(key)
                _WAITED.pop(id(item.work), None)
                item.work = None
            self._untimed += len(stale)
            self._waited_items -= len(stale)

    def _finish(self, item: _Pending, ended: float) -> None:
        with self._lock:
            if self._pending.pop(id(item), None) is None:
                return
            if item.thread:
                _WAITED.pop(id(item.work), None)
                self._waited_items -= 1
            key = (item.kind, item.dim)
            self._seconds[key] = self._seconds.get(key, 0.0) + (ended - item.started)
            self._step_intervals.append((item.started, ended))
        item.work = None  # let torch free it

    def _oldest_pending(self) -> InFlight | None:
        with self._lock:
            item = next(iter(self._pending.values()), None)
        if item is None:
            return None
        return InFlight(-1, item.kind, item.dim, item.group, 0, item.wall_started)

    # --- training thread ------------------------------------------------------------------------

    @property
    def times_steps(self) -> bool:
        """Whether `take_step` sees every collective (all groups hook-timed: no NCCL group)."""
        return self._timing and bool(self._hooked) and not self._nccl

    def take_step(self, since: float = float("-inf")) -> list[tuple[float, float]]:
        """The intervals (perf_counter) of the collectives finished since the last call, clipped to start
        no earlier than `since` (the step's start: what ran between steps, such as the control channel's
        exchange, is not the step's)."""
        self.attach_groups()
        if self._waited_items:
            self._drop_unwaited(threading.get_ident())
        with self._lock:
            intervals, self._step_intervals = self._step_intervals, []
        return [(max(start, since), end) for start, end in intervals if end > since] if intervals else intervals

    # --- metrics thread -----------------------------------------------------------------------

    def read(self) -> None:
        """Bring counts, times and what is in flight up to date for a scrape: from the hooks alone while every
        group is hooked (gloo), else also from the Flight Recorder's records newer than the last read. Never
        blocks on a collective (FR's dump copies its ring buffer under its own mutex)."""
        if not self.enabled:
            return
        with self._read_lock:  # two scrapes at once read once each, in turn
            started = time.perf_counter()
            try:
                if self._unhooked or not self._timing:
                    self._read()
                else:
                    self.in_flight = self._oldest_pending()
            finally:
                self.read_seconds = time.perf_counter() - started

    def _dump(self) -> list[dict[str, Any]]:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]

        self.recorder_dumps += 1
        dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
        return list(dump.get("entries") or [])

    def _dump_seq(self) -> dict[str, tuple[int, int]]:
        """Per process group, the highest (collective, p2p) sequence ids in the Flight Recorder now."""
        seq: dict[str, tuple[int, int]] = {}
        for entry in self._dump():
            group, _desc = _pg_of(entry)
            known = seq.get(group, (0, 0))
            collective, p2p = int(entry.get("collective_seq_id") or 0), int(entry.get("p2p_seq_id") or 0)
            seq[group] = (max(known[0], collective), max(known[1], p2p))
        return seq

    def _read(self) -> None:
        entries = self._dump()
        oldest: InFlight | None = None
        last = self._last_record
        for entry in entries:
            record = int(entry.get("record_id", -1))
            group, _desc = _pg_of(entry)
            finished = bool(entry.get("retired")) or entry.get("state") == "completed"
            seq = self._seq.get(group, (0, 0))
            collective, p2p = int(entry.get("collective_seq_id") or 0), int(entry.get("p2p_seq_id") or 0)
            if collective > seq[0] or p2p > seq[1]:
                self._seq[group] = (max(seq[0], collective), max(seq[1], p2p))
            if record > last:
                self._last_record = max(self._last_record, record)
                dim = self.dim_of(group)
                if entry.get("duration_ms") is None and not finished and "nccl" in str(entry.get("profiling_name")):
                    self._open_nccl[record] = (kind_of(str(entry.get("profiling_name", ""))), dim)
                elif entry.get("duration_ms") is not None:
                    self._add_fr_seconds(entry, dim)
            elif record in self._open_nccl and entry.get("duration_ms") is not None:
                kind_dim = self._open_nccl.pop(record)
                self._fr_seconds[kind_dim] = self._fr_seconds.get(kind_dim, 0.0) + float(entry["duration_ms"]) / 1e3
            nccl = str(entry.get("profiling_name", "")).startswith("nccl:")
            # gloo's in-flight state comes from the hooks: FR leaves composite works' records unretired
            if nccl and not finished and (oldest is None or record < oldest.record_id):
                oldest = InFlight(
                    record,
                    kind_of(str(entry.get("profiling_name", ""))),
                    self.dim_of(group),
                    group,
                    int(entry.get("collective_seq_id") or entry.get("p2p_seq_id") or 0),
                    int(entry.get("time_created_ns") or 0) / 1e9,
                )
        if len(self._open_nccl) > 4 * DEFAULT_BUFFER_SIZE:  # records that left the ring unfinished
            self._open_nccl.clear()
        self.in_flight = self._oldest_pending() or oldest

    def _add_fr_seconds(self, entry: dict[str, Any], dim: str) -> None:
        key = (kind_of(str(entry.get("profiling_name", ""))), dim)
        self._fr_seconds[key] = self._fr_seconds.get(key, 0.0) + float(entry["duration_ms"]) / 1e3

    def started_by_dim(self) -> dict[str, int]:
        """Collectives started by this rank, per dim: a hooked group's from its hooks (plus its baseline), any
        other group's from FR's sequence ids as of the last read. Each group from one source, never both."""
        with self._lock:
            hooked = {group: count + self._baseline.get(group, 0) for group, count in self._issued_count.items()}
        totals = {group: collective + p2p for group, (collective, p2p) in self._seq.items()}
        for group, count in hooked.items():
            # FR's ids are from a read before the group was hooked (or after a hook failed, when FR is read again
            # and lacks gloo's send/recv): the larger keeps the counter from going down.
            totals[group] = max(count, totals.get(group, 0))
        started: dict[str, int] = {}
        for group, count in totals.items():
            dim = self.dim_of(group)
            started[dim] = started.get(dim, 0) + count
        return started

    def seconds_by_kind_dim(self) -> dict[tuple[str, str], float]:
        """Seconds in collectives per (kind, dim): hook-timed (gloo) plus FR-timed (NCCL), disjoint groups."""
        with self._lock:
            total = dict(self._seconds)
        for key, value in self._fr_seconds.items():
            total[key] = total.get(key, 0.0) + value
        return total


# A hook's op (torch's HookOpName) -> kind; filled as ops are first seen.
_HOOK_KINDS: dict[Any, str] = {}

_HOOK_IDS = itertools.count(0x52534B00)  # each view's own post-hook id: two monitors in a process never clash

# Blocking composite works being waited for (id(work) -> what ends their timing), and whether `Work.wait` tells.
_WAITED: dict[int, Callable[[], None]] = {}
_wait_watched: bool | None = None


def _watch_wait() -> bool:
    """Wrap ``Work.wait`` once per process so that the end of a watched work's wait is seen; False if torch's
    Work type cannot be wrapped. The wrapper calls torch's wait unchanged and returns what it returns; for a
    work nobody watches it costs one dict lookup."""
    global _wait_watched
    if _wait_watched is not None:
        return _wait_watched
    try:
        from torch.distributed import Work

        torch_wait = Work.wait

        @functools.wraps(torch_wait)
        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                done = torch_wait(self, *args, **kwargs)
            except BaseException:
                _WAITED.pop(id(self), None)  # it failed (a timeout, an abort): not a collective that completed
                raise
            ended = _WAITED.pop(id(self), None)
            if ended is not None:
                with contextlib.suppress(Exception):  # never into the caller's wait: that one is untimed
                    ended()
            return done

        setattr(Work, "wait", wait)  # noqa: B010  (a method of torch's pybind type)
        _wait_watched = True
    except Exception as exc:  # a torch whose Work cannot be wrapped: blocking composites stay untimed
        logger.warning("rankscope: cannot time gloo's composite collectives (reduce-scatter): %r", exc)
        _wait_watched = False
    return _wait_watched


@dataclass(slots=True)
class _Pending:
    kind: str
    dim: str
    group: str
    started: float  # perf_counter
    wall_started: float  # Unix seconds
    work: Any
    thread: int = 0  # a blocking composite's issuing thread (its end is that thread's wait), else 0


def _group_name(group: Any) -> str:
    name = getattr(group, "group_name", None)
    if name is None:
        import torch.distributed as dist

        name = dist.distributed_c10d._get_process_group_name(group)
    return str(name)


def _pg_of(entry: dict[str, Any]) -> tuple[str, str]:
    pg = entry.get("process_group") or ("", "")
    return str(pg[0]), str(pg[1] if len(pg) > 1 else "")


def known_dims(values: Iterable[str]) -> bool:
    return all(value in DIMS for value in values)
