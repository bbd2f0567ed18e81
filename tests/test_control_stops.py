"""rankscope.control.stops: signal handling that never keeps a rank from exiting.

DataLoader workers ignore SIGTERM while the rank handles stop signals (the rank decides when to stop),
so multiprocessing's SIGTERM to its daemon children at interpreter exit cannot end them: a rank that an
uncaught exception ends while its DataLoader still runs would wait on them forever (until torchrun's
SIGKILL, 30 s later, or for ever outside torchrun). Real processes: a rank-like script, a real
DataLoader with a forked worker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support import REPO

RANK = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader

    from rankscope.control.stops import StopSignals, ignore_stop_signals

    stops = StopSignals()  # as a ControlChannel installs it on every rank
    loader = DataLoader(list(range(1000)), batch_size=1, num_workers=1, worker_init_fn=ignore_stop_signals)
    batches = iter(loader)  # held, as a trainer holds its epoch's iterator: alive until the interpreter exits
    for batch in batches:
        if int(batch) == 3:
            raise RuntimeError("a bug in the loop")  # uncaught
    """
)


def test_a_rank_ended_by_an_uncaught_exception_exits_although_its_workers_ignore_sigterm() -> None:
    try:
        result = subprocess.run([sys.executable, "-c", RANK], cwd=REPO, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("the process did not exit: it waits on DataLoader workers that ignore SIGTERM") from None
    assert result.returncode == 1 and "a bug in the loop" in result.stderr, result.stderr[-2000:]
    assert "is killed by signal" not in result.stderr, result.stderr[-2000:]  # the bug stays the last word
