"""rankscope_run_info's backend label is the process group's whichever comes first, the Monitor or
init_process_group (issue 33 item 4): a real gloo group of 2 processes, the page read over HTTP."""

from __future__ import annotations

import traceback
from typing import Any

import pytest

from tests.support import samples
from tests.test_collectives import _init, _monitor, _page, _spawn

pytestmark = pytest.mark.integration


def _backends(page: str) -> list[str]:
    return [dict(labels)["backend"] for name, labels in samples(page) if name == "rankscope_run_info"]


def _order_worker(rank: int, world: int, port: int, queue: Any, monitor_first: bool) -> None:
    try:
        _init(rank, world, port)
        import torch.distributed as dist

        found: dict[str, Any] = {"rank": rank}
        monitor = _monitor() if monitor_first else None
        if monitor is not None:
            found["before_group"] = _backends(_page(monitor))
        dist.init_process_group("gloo")
        monitor = monitor or _monitor()
        found["with_group"] = _backends(_page(monitor))
        dist.barrier()
        monitor.close()
        dist.destroy_process_group()
        queue.put(found)
    except Exception:
        queue.put({"rank": rank, "error": traceback.format_exc()})


@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "group-first"])
def test_run_info_names_the_group_s_backend_whichever_is_created_first(monitor_first: bool) -> None:
    for found in _spawn(_order_worker, 2, monitor_first):
        assert found["with_group"] == ["gloo"], found
        if monitor_first:
            assert found["before_group"] == ["none"], found  # no group yet: none is true then
