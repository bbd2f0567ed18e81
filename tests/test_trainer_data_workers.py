"""The training loader's workers cannot inherit a lock held by one of the rank's threads.

A rank runs threads beside its loop (the metrics server, the control endpoint, the goodput ledger,
gloo's). A DataLoader worker forked from the rank copies every lock those threads hold at that instant,
held for ever in the child; a 2-rank run hung before its first step that way. The case built here is a
module that another thread is importing while the workers start, and that the workers import too.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading

import psutil
import pytest
import torch
from rankscope_trainer.config import DataConfig, SyntheticConfig
from rankscope_trainer.data import build_data, worker_context
from torch.utils.data import DataLoader, Dataset

from tests import import_gate
from tests.support import REPO

#: Seconds a worker may take for one item before the loader gives up: the failure this test detects,
#: never reached by a worker that is not blocked (each item takes milliseconds).
BLOCKED_AFTER_SECONDS = 60
#: A worker sees its rank end at once (`rankscope.control.WorkerInit`); the rest is margin for a loaded machine.
WORKERS_GONE_WITHIN_SECONDS = 60


class ImportsTheGatedModule(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        import tests.import_gated  # noqa: F401  (the import is the point)

        return index


@pytest.fixture
def import_in_progress():
    """A thread inside `import tests.import_gated`, holding that module's import lock, until the test ends."""
    import_gate.arm()
    thread = threading.Thread(target=importlib.import_module, args=("tests.import_gated",), daemon=True)
    thread.start()
    import_gate.entered.wait()
    yield
    import_gate.release()
    thread.join()


def test_a_module_another_thread_is_importing_as_the_workers_start_does_not_block_them(import_in_progress) -> None:
    loader = DataLoader(
        ImportsTheGatedModule(),
        batch_size=2,
        num_workers=1,
        timeout=BLOCKED_AFTER_SECONDS,
        multiprocessing_context=worker_context(),
    )
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]


def test_the_training_loader_starts_its_workers_that_way_and_yields_what_in_process_loading_does() -> None:
    def batches(num_workers: int) -> tuple[DataLoader, list[torch.Tensor]]:
        cfg = DataConfig(
            batch_size=4, num_workers=num_workers, synthetic=SyntheticConfig(train_size=16, val_size=4, image_size=24)
        )
        loader = build_data(cfg, image_size=24, seed=3, rank=0, world_size=1).train_loader
        return loader, [batch.images for batch in loader]

    loader, with_workers = batches(num_workers=1)
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    _, in_process = batches(num_workers=0)
    assert len(with_workers) == len(in_process) == 4
    assert all(torch.equal(a, b) for a, b in zip(with_workers, in_process, strict=True))


RANK = """
import os, sys
from rankscope_trainer.config import DataConfig, SyntheticConfig
from rankscope_trainer.data import build_data
cfg = DataConfig(batch_size=2, num_workers=2, synthetic=SyntheticConfig(train_size=64, val_size=4, image_size=24))
batches = iter(build_data(cfg, image_size=24, seed=0, rank=0, world_size=1).train_loader)
next(batches)
print(" ".join(str(w.pid) for w in batches._workers), flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_rank_killed_with_sigkill_leaves_no_worker_behind() -> None:
    """The workers end with their rank: a fork server's worker is the server's child, and the server
    outlives a rank killed with SIGKILL; a worker that outlived its rank would hold its memory for ever."""
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True
    )
    try:
        workers = [psutil.Process(int(pid)) for pid in rank.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(workers) == 2
    finally:
        rank.kill()
        rank.wait()
    _, alive = psutil.wait_procs(workers, timeout=WORKERS_GONE_WITHIN_SECONDS)
    for process in alive:
        process.kill()
    assert not alive, f"workers {[p.pid for p in alive]} outlived their rank"
