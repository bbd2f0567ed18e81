"""The data loader's fork server forked from the rank (`rankscope_trainer.fork_server`): the training loader's
workers come from it, with the data the stock server's workers give, and it ends with its rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import psutil

from tests.support import REPO

#: A worker or server sees its rank end at once (`rankscope.control.WorkerInit`, the server's liveness pipe);
#: the rest is margin for a loaded machine.
GONE_WITHIN_SECONDS = 60

RANK = """
import json, os, sys, threading
import psutil, torch
from rankscope_trainer.config import DataConfig, SyntheticConfig
from rankscope_trainer.data import build_data
from rankscope_trainer.fork_server import start_fork_server
if sys.argv[1] == "thread":
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
server = start_fork_server()
def batches(workers):
    cfg = DataConfig(batch_size=4, num_workers=workers, synthetic=SyntheticConfig(train_size=16, val_size=4,
                     image_size=24))
    return iter(build_data(cfg, image_size=24, seed=3, rank=0, world_size=1).train_loader)
with_workers = batches(2)
first = next(with_workers)
workers = [psutil.Process(w.pid) for w in with_workers._workers]
in_process = list(batches(0))
same = all(torch.equal(a.images, b.images) for a, b in zip([first, *with_workers], in_process, strict=True))
print(json.dumps({"server": server, "same": same, "workers": [w.pid for w in workers],
                  "parents": [w.ppid() for w in workers],
                  "grandparents": [psutil.Process(w.ppid()).ppid() for w in workers],
                  "parent_cmdlines": [psutil.Process(w.ppid()).cmdline() for w in workers]}), flush=True)
sys.stdin.read()  # until the test ends this process
del with_workers  # its persistent workers stop, as the trainer stops its loaders before it exits
"""


def _start_rank(mode: str) -> tuple[subprocess.Popen[str], dict]:
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True
    )
    line = rank.stdout.readline()  # type: ignore[union-attr]
    assert line, f"the rank ended with status {rank.wait()} before it reported"
    return rank, json.loads(line)


def _gone(pids: list[int]) -> list[int]:
    """Waits for `pids` to end; the ones still alive (then killed)."""
    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):  # gone already
            processes.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(processes, timeout=GONE_WITHIN_SECONDS)
    for process in alive:
        process.kill()
    return [process.pid for process in alive]


def test_the_workers_come_from_a_fork_of_the_rank_with_the_data_in_process_loading_gives() -> None:
    rank, seen = _start_rank("alone")
    try:
        assert seen["server"] is not None
        assert seen["parents"] == [seen["server"]] * 2  # forked by that server...
        assert seen["grandparents"] == [rank.pid] * 2  # ...which the rank forked: no fresh interpreter
        assert seen["same"], "the workers' batches differ from in-process loading's"
    finally:
        rank.stdin.close()  # type: ignore[union-attr]
        rank.wait(timeout=GONE_WITHIN_SECONDS)  # it stops its workers and exits at once
    assert not _gone([*seen["workers"], seen["server"]]), "the fork server or a worker outlived its rank"


def test_a_rank_killed_with_sigkill_leaves_neither_its_fork_server_nor_a_worker_behind() -> None:
    rank, seen = _start_rank("alone")
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    assert not _gone([*seen["workers"], seen["server"]]), "the fork server or a worker outlived its rank"


def test_with_a_thread_running_the_stock_fork_server_starts_instead() -> None:
    """A fork taken while another thread runs could inherit a lock that thread holds: not taken."""
    rank, seen = _start_rank("thread")
    try:
        assert seen["server"] is None
        assert all("from multiprocessing.forkserver import main" in " ".join(c) for c in seen["parent_cmdlines"])
        assert seen["same"]
    finally:
        rank.stdin.close()  # type: ignore[union-attr]
        rank.wait(timeout=GONE_WITHIN_SECONDS)  # it stops its workers and exits at once
    _gone(seen["workers"])


TRAINER = """
import sys, psutil, rankscope_trainer.loop
seen = []
original = rankscope_trainer.loop.Trainer.__init__
def init(self, *args, **kwargs):  # the fork server forked before the trainer starts its first thread
    seen.extend(c.cmdline() for c in psutil.Process().children())
    original(self, *args, **kwargs)
    raise SystemExit(0 if seen and seen[0] == psutil.Process().cmdline() else f"rank's children: {seen}")
rankscope_trainer.loop.Trainer.__init__ = init
from rankscope_trainer.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_reference_trainer_forks_it_before_it_starts(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", TRAINER, "--config", "trainer/rankscope_trainer/configs/test.yaml",
         "--set", f"checkpoint.dir={tmp_path}", "--set", "metrics.enabled=false", "--set", "data.num_workers=1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
