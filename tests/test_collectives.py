"""Every collective seen (issue 22 item 1): FSDP2's all-gathers and reduce-scatters under a real gloo group of
2 processes, counted and timed by kind and mesh dimension from torch's Flight Recorder, read from the rank's own
metrics page over HTTP; DDP's buckets timed once."""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from rankscope.collectives import dim_of_mesh_name, kind_of

from devstack.ports import free_port
from tests.support import fetch, sample_value, samples

pytestmark = pytest.mark.integration


def test_op_names_map_to_bounded_kinds() -> None:
    assert kind_of("gloo:all_gather") == "all_gather"
    assert kind_of("nccl:_allgather_base") == "all_gather"
    assert kind_of("gloo:reduce_scatter") == "reduce_scatter"
    assert kind_of("nccl:reduce_scatter_tensor_coalesced") == "reduce_scatter"
    assert kind_of("gloo:all_reduce") == "all_reduce"
    assert kind_of("nccl:send 0->1") == "send_recv"
    assert kind_of("HookOpName.BARRIER") == "barrier"
    assert kind_of("gloo:alltoall") == "other"
    assert [dim_of_mesh_name(n) for n in ("dp_shard", "tp", "pp", "cp", "ep2", None)] == [
        "data", "tensor", "pipeline", "context", "other", "other",
    ]  # fmt: skip


def _spawn(worker: Any, world: int, *args: Any) -> list[dict[str, Any]]:
    queue = mp.get_context("spawn").SimpleQueue()
    port = free_port()
    mp.spawn(worker, args=(world, port, queue, *args), nprocs=world, join=True)
    results = [queue.get() for _ in range(world)]
    failures = [r["error"] for r in results if "error" in r]
    assert not failures, "\n".join(failures)
    return sorted(results, key=lambda r: r["rank"])


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), RANKSCOPE_RUN_ID="collectives",
    )  # fmt: skip
    torch.set_num_threads(1)


def _monitor() -> Any:
    from rankscope import Monitor, MonitorConfig

    monitor = Monitor(MonitorConfig(base_port=0, page_cache_seconds=0, goodput=False, probes=()))
    monitor.start()
    return monitor


def _page(monitor: Any) -> str:
    return fetch(f"http://127.0.0.1:{monitor.port}/metrics")


def _fsdp_worker(rank: int, world: int, port: int, queue: Any, steps: int) -> None:
    try:
        _init(rank, world, port)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        monitor = _monitor()  # before init_process_group: it makes sure the Flight Recorder records
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        monitor.watch_mesh(mesh)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in monitor.data(range(steps)):
            with monitor.step():
                model(torch.randn(8, 32)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        page = _page(monitor)
        dist.barrier()
        monitor.close()
        dist.destroy_process_group()
        queue.put({"rank": rank, "page": page})
    except Exception:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _value(page: str, name: str, **labels: str) -> float | None:
    return sample_value(samples(page), name, **labels)


def test_fsdp2_all_gathers_and_reduce_scatters_are_counted_and_timed_as_data_parallel() -> None:
    steps = 4
    for result in _spawn(_fsdp_worker, 2, steps):
        page = result["page"]
        for kind in ("all_gather", "reduce_scatter"):
            seconds = _value(page, "rankscope_collective_seconds_total", kind=kind, dim="data")
            assert seconds is not None and seconds > 0, f"rank {result['rank']}: no {kind} time\n{page}"
        started = _value(page, "rankscope_collectives_total", dim="data")
        # 4 FSDP units, each step: an all-gather in forward, most again in backward, a reduce-scatter each.
        assert started is not None and started >= steps * 4 * 2, page
        comm = _value(page, "rankscope_comm_duration_seconds_count")
        assert comm == steps, f"the comm histogram is fed once per step from the view\n{page}"
        comm_sum = _value(page, "rankscope_comm_duration_seconds_sum")
        step_sum = _value(page, "rankscope_step_duration_seconds_sum")
        assert 0 < comm_sum < step_sum
        assert _value(page, "rankscope_phase") is not None


class _Straggle(torch.autograd.Function):
    """Identity forward; in backward, this rank arrives `seconds` late at the gradient reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import time

        time.sleep(ctx.seconds)  # the straggler's extra work: its peer waits this long in the reduce-scatter
        return grad, None


def _reduce_scatter_worker(rank: int, world: int, port: int, queue: Any, steps: int, late: float) -> None:
    try:
        _init(rank, world, port)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        monitor = _monitor()
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        monitor.watch_mesh(mesh)
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 32)
        fully_shard(model, mesh=mesh)  # one unit, the root: backward's only collective is its reduce-scatter
        for _ in monitor.data(range(steps)):
            with monitor.step():
                _Straggle.apply(model(torch.randn(8, 32)).sum(), late if rank == 1 else 0.0).backward()
        page = _page(monitor)
        dist.barrier()
        monitor.close()
        dist.destroy_process_group()
        queue.put({"rank": rank, "page": page})
    except Exception:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def test_fsdp2_s_gradient_reduce_scatter_on_gloo_is_timed_as_communication_not_compute() -> None:
    steps, late = 3, 0.3
    rank0 = _spawn(_reduce_scatter_worker, 2, steps, late)[0]
    page = rank0["page"]
    # Rank 0 waits for its late peer inside each step's reduce-scatter: that wait is communication.
    waited = steps * late * 0.6  # allowing for the late rank's scheduling on a loaded machine
    seconds = _value(page, "rankscope_collective_seconds_total", kind="reduce_scatter", dim="data")
    assert seconds is not None and seconds >= waited, f"the reduce-scatter is not timed\n{page}"
    comm = _value(page, "rankscope_comm_duration_seconds_sum")
    assert comm >= waited, f"the step's comm time misses the reduce-scatter\n{page}"
    compute = _value(page, "rankscope_compute_duration_seconds_sum")
    step = _value(page, "rankscope_step_duration_seconds_sum")
    assert compute <= step - waited, page


def _recorder_counts() -> dict[str, int]:
    """Per process group, the collectives torch's Flight Recorder says this rank started (its sequence ids)."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
    counts: dict[str, int] = {}
    for entry in dump.get("entries") or []:
        group = str(entry["process_group"][0])
        counts[group] = max(counts.get(group, 0), int(entry.get("collective_seq_id") or 0))
    return counts


def _scrape_cost_worker(rank: int, world: int, port: int, queue: Any, steps: int) -> None:
    try:
        _init(rank, world, port)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        monitor = _monitor()
        dist.init_process_group("gloo")
        dist.barrier()  # started before any step: counted from the recorder when the step's end hooks the group
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        monitor.watch_mesh(mesh)
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16)
        fully_shard(model, mesh=mesh)
        dumps, served = [], []  # (the pipe under the queue is small: results, not pages)
        for _ in monitor.data(range(steps)):
            with monitor.step():
                model(torch.randn(4, 16)).sum().backward()
            before = monitor.collectives.recorder_dumps
            _page(monitor)
            served.append(_value(_page(monitor), "rankscope_collectives_total", dim="data"))
            dumps.append(monitor.collectives.recorder_dumps - before)  # recorder dumps these two scrapes made
        recorder = _recorder_counts()
        monitor.close()
        dist.barrier()
        dist.destroy_process_group()
        queue.put({"rank": rank, "dumps": dumps, "served": served, "recorder": recorder})
    except Exception:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def test_on_gloo_a_scrape_counts_from_the_hooks_without_dumping_the_recorder_and_matches_its_counts() -> None:
    steps = 3
    for result in _spawn(_scrape_cost_worker, 2, steps):
        # Each dump copies the whole ring (about 1 ms even when it holds a few records): once every group is
        # hooked, at the first step's end, a scrape needs none.
        assert result["dumps"] == [0] * steps, result
        # The counts served equal the recorder's own, the barrier before the first step (the baseline) included.
        assert result["served"][-1] == sum(result["recorder"].values()), result
        assert result["served"] == sorted(result["served"]) and result["served"][0] >= 1 + 2, result


def _ddp_worker(rank: int, world: int, port: int, queue: Any, steps: int) -> None:
    try:
        _init(rank, world, port)
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        monitor = _monitor()
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)))
        monitor.attach_comm_hook(model)
        for _ in monitor.data(range(steps)):
            with monitor.step():
                model(torch.randn(8, 64)).sum().backward()
        page = _page(monitor)
        dist.barrier()
        monitor.close()
        dist.destroy_process_group()
        queue.put({"rank": rank, "page": page})
    except Exception:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def test_ddp_buckets_are_timed_by_the_comm_hook_once_and_seen_by_the_view() -> None:
    steps = 3
    for result in _spawn(_ddp_worker, 2, steps):
        page = result["page"]
        # One source per metric: the DDP hook feeds the comm histogram (once per step), the view the counters.
        assert _value(page, "rankscope_comm_duration_seconds_count") == steps, page
        assert _value(page, "rankscope_compute_duration_seconds_count") == steps, page
        assert _value(page, "rankscope_comm_duration_seconds_sum") < _value(page, "rankscope_step_duration_seconds_sum")
        seconds = _value(page, "rankscope_collective_seconds_total", kind="all_reduce", dim="data")
        assert seconds is not None and seconds > 0, page
        assert _value(page, "rankscope_collectives_total", dim="data") >= steps, page


def _tp_worker(rank: int, world: int, port: int, queue: Any, steps: int) -> None:
    try:
        _init(rank, world, port)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        monitor = _monitor()
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        monitor.watch_mesh(mesh)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for _ in monitor.data(range(steps)):
            with monitor.step():
                model(torch.randn(4, 16)).sum().backward()
        page = _page(monitor)
        dist.barrier()
        monitor.close()
        dist.destroy_process_group()
        queue.put({"rank": rank, "page": page})
    except Exception:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def test_tensor_parallel_collectives_are_labelled_with_the_tensor_dim() -> None:
    for result in _spawn(_tp_worker, 4, 2):
        page = result["page"]
        assert _value(page, "rankscope_collectives_total", dim="tensor") >= 2, page
        seconds = _value(page, "rankscope_collective_seconds_total", kind="all_reduce", dim="tensor")
        assert seconds is not None and seconds > 0, page


def _in_flight_worker(rank: int, world: int, port: int, queue: Any, signal_file: str) -> None:
    try:
        _init(rank, world, port)
        import time
        from pathlib import Path

        import torch.distributed as dist
        from rankscope.control.stacks import fold, own_stacks, render

        monitor = _monitor()
        dist.init_process_group("gloo")
        with monitor.step():  # the step's end attaches the view's hooks to the group
            dist.barrier()
        found: dict[str, Any] = {"rank": rank}
        if rank == 0:
            work = dist.all_reduce(torch.ones(4), async_op=True)  # rank 1 joins only once this was read
            found["during"] = monitor.collective_in_flight()
            found["summary"] = render(fold({0: own_stacks(0, monitor.collective_in_flight)}), full=False)
            Path(signal_file).write_text("read")
            work.wait()
            deadline = time.monotonic() + 60
            while monitor.collective_in_flight() is not None and time.monotonic() < deadline:
                time.sleep(0.05)  # the completion callback runs on gloo's thread, just after wait() returns
            found["after"] = monitor.collective_in_flight()
        else:
            found["before_joining"] = monitor.collective_in_flight()
            deadline = time.monotonic() + 120  # rank 0 failing before the signal must not leave this rank spinning
            while not Path(signal_file).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0 never read its collective in flight")
                time.sleep(0.05)
            dist.all_reduce(torch.ones(4))
        dist.barrier()
        monitor.close()
        dist.destroy_process_group()
        queue.put(found)
    except Exception:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def test_a_rank_waiting_in_a_collective_says_which_in_its_stacks_and_the_rank_outside_it_does_not(tmp_path) -> None:
    rank0, rank1 = _spawn(_in_flight_worker, 2, str(tmp_path / "read"))
    during = rank0["during"]
    assert (during["kind"], during["dim"]) == ("all_reduce", "data"), during
    assert during["since"] > 0
    assert rank0["summary"].startswith("rank 0: in all_reduce (data): "), rank0["summary"]
    assert rank0["after"] is None
    assert rank1["before_joining"] is None
