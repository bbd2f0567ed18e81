"""Progress a hang cannot freeze (issue 26 item 1): each rank's phase, read from its metrics page over HTTP while
its training thread is blocked (in a collective, in compute, in the data loader, in a checkpoint), under a real
gloo group of 2 processes. Every wait is on an event the test sets once it has seen the page it expects."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from rankscope.contract import PHASES
from rankscope.progress import PHASE_INDEX, ProgressTracker

from devstack.ports import free_port
from tests.support import fetch, sample_value, samples, wait_for

pytestmark = pytest.mark.integration

#: Events the test sets, in this order, once each rank's page shows what the rank is blocked in.
GATES = ("checkpoint", "hang_in_collective", "hang_in_data", "pause")


def test_nested_phases_return_to_what_came_before() -> None:
    tracker = ProgressTracker()
    tracker.begin_step()
    assert tracker.current(None)[0] == PHASE_INDEX["compute"]
    with tracker.holding("validation"):
        assert tracker.state[0] == PHASE_INDEX["validation"]
        with tracker.holding("checkpoint"):
            assert tracker.state[0] == PHASE_INDEX["checkpoint"]
        assert tracker.state[0] == PHASE_INDEX["validation"]
    assert tracker.state[0] == PHASE_INDEX["compute"]
    with pytest.raises(ValueError, match="unknown phase 'saving'"), tracker.holding("saving"):
        pass


def test_the_null_monitor_takes_the_same_phase_calls() -> None:
    from rankscope import NullMonitor

    monitor = NullMonitor()
    with monitor.phase("checkpoint"):
        monitor.watch_mesh(object())


def _worker(rank: int, port: int, queue: Any, gates: dict[str, Any]) -> None:
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2", RANKSCOPE_RUN_ID="progress",
        )  # fmt: skip
        torch.set_num_threads(1)
        import torch.distributed as dist
        from rankscope import Monitor, MonitorConfig

        monitor = Monitor(MonitorConfig(base_port=0, page_cache_seconds=0, goodput=False, probes=()))
        monitor.start()
        dist.init_process_group("gloo")
        queue.put({"rank": rank, "port": monitor.port})
        tensor = torch.ones(4)
        for _ in monitor.data(range(1)):
            with monitor.step():
                dist.all_reduce(tensor)
        # Rank 0 checkpoints while rank 1 validates, each held until the test has seen both.
        with monitor.phase("checkpoint" if rank == 0 else "validation"):
            gates["checkpoint"].wait()
        # Rank 1 computes (blocked) while rank 0 waits for it in the all-reduce.
        with monitor.step():
            if rank == 1:
                gates["hang_in_collective"].wait()
            dist.all_reduce(tensor)

        # Rank 1's data loader blocks while rank 0 waits in the all-reduce.
        def batches() -> Any:
            if rank == 1:
                gates["hang_in_data"].wait()
            yield 0

        for _ in monitor.data(batches()):
            with monitor.step():
                dist.all_reduce(tensor)
        with monitor.phase("paused"):  # what the control channel does while a pause holds the loop
            gates["pause"].wait()
        dist.barrier()
        monitor.close()
        dist.destroy_process_group()
        queue.put({"rank": rank, "done": True})
    except Exception:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _phase(url: str) -> tuple[str, float]:
    page = samples(fetch(url))
    index = sample_value(page, "rankscope_phase")
    since = sample_value(page, "rankscope_phase_started_timestamp_seconds")
    assert index is not None and since is not None
    return PHASES[int(index)], since


def test_each_rank_shows_what_it_is_blocked_in_while_blocked() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    gates = {name: ctx.Event() for name in GATES}
    procs = mp.start_processes(_worker, args=(free_port(), queue, gates), nprocs=2, join=False, start_method="spawn")
    try:
        started = [queue.get() for _ in range(2)]
        assert not [s["error"] for s in started if "error" in s]
        urls = {s["rank"]: f"http://127.0.0.1:{s['port']}/metrics" for s in started}

        def expect(gate: str, wanted: dict[int, str]) -> None:
            seen: dict[int, tuple[str, float]] = {}

            def shown() -> bool:
                seen.update({rank: _phase(url) for rank, url in urls.items()})
                return all(seen[rank][0] == phase for rank, phase in wanted.items())

            wait_for(shown, 60, f"phases {wanted} before releasing {gate} (last seen: {seen})")
            for rank, (_phase_name, since) in seen.items():
                assert time.time() - 60 < since <= time.time(), f"rank {rank}: phase began at {since}"
            gates[gate].set()

        expect("checkpoint", {0: "checkpoint", 1: "validation"})
        expect("hang_in_collective", {0: "collective", 1: "compute"})
        expect("hang_in_data", {0: "collective", 1: "data_wait"})
        expect("pause", {0: "paused", 1: "paused"})
        finished = [queue.get() for _ in range(2)]
        assert not [f["error"] for f in finished if "error" in f]
        deadline = time.monotonic() + 60
        while not procs.join(timeout=5):  # one process per call; raises if one failed
            assert time.monotonic() < deadline, "the ranks did not exit"
    finally:
        for gate in gates.values():
            gate.set()
        for process in procs.processes:
            if process.is_alive():
                process.kill()  # this test's own child, by its handle
