"""The demo's running commentary: alerts as they fire and resolve, actions as every rank applies them.

A thread of the stack launcher polls Prometheus's alerts API and the trainer's control status once a
second and prints what changed, so a person watching `make demo` sees the loop close: the fault's
alert firing, the action it caused applied on all ranks at one step, and the loss after it.

Scenarios (`make demo SCENARIO=...`) switch a fault on partway through the run, chosen so that the
shipped rules (5 s scrapes, their real `for`s) turn it into an action within the demo's minutes.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from rankscope.report.errors import ReportError
from rankscope.report.prom import Prometheus

__all__ = ["SCENARIOS", "Narrator", "Scenario"]


@dataclass(frozen=True)
class Scenario:
    """A fault for the demo and what a person should expect to see."""

    settings: tuple[str, ...]
    """Trainer `--set` overrides that switch the fault on."""
    expect: str
    """One line for the banner."""

    @property
    def fault_step(self) -> int | None:
        """The step its fault starts at (None: no fault)."""
        steps = [int(value) for key, value in (s.split("=", 1) for s in self.settings) if key.endswith(".at_step")]
        return min(steps) if steps else None


SCENARIOS: dict[str, Scenario] = {
    "none": Scenario((), "no fault: a healthy run (no alert should fire)"),
    "nonfinite": Scenario(
        ("faults.nonfinite.at_step=300", "faults.nonfinite.steps=5", "faults.nonfinite.rank=0"),
        "from step 300, 5 NaN losses on rank 0: RankscopeNonFiniteSteps fires and the trainer reduces the LR "
        "(within seconds); every rank skips those updates",
    ),
    # Later than the others: the alert compares the 2m-smoothed loss with its minimum, and a minimum taken
    # while the first, untrained steps fill the window is too high. Measured on the demo config, 3000 steps
    # at 90 ms (the fastest here): at step 300, 9x took the loss from 0.5 to 2.5-3.2 for 1400 steps and
    # stayed under twice the minimum (1.14); at step 1200 it took it from 0.09 to 2.5, the minimum was
    # 0.30, and the rule replayed on the log fired at step 2582 (the whole demo: applied at step 2568).
    "divergence": Scenario(
        ("faults.diverge.at_step=1200", "faults.diverge.lr_factor=9"),
        "from step 1200 the learning rate is 9x too high: the loss climbs at once, RankscopeLossDiverging "
        "fires some 2-3 minutes later (2m smoothing, then its 2m `for`) and the trainer halves the LR",
    ),
    "straggler": Scenario(
        ("faults.straggler.at_step=300", "faults.straggler.rank=1", "faults.straggler.seconds=0.2"),
        "from step 300 rank 1 is 3x slower: RankscopeRankImbalance pages naming rank 1 after its 10m `for` "
        "(nothing to act on)",
    ),
}


class Narrator:
    """Polls and prints; `stop()` ends it. Reading failures are silent: the servers may be starting."""

    def __init__(
        self,
        prometheus: str,
        control: str,
        token: str,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
        interval: float = 1.0,
    ) -> None:
        self._prometheus, self._control, self._token = Prometheus(prometheus, timeout=3), control, token
        self._say, self._interval = say, interval
        self._firing: set[tuple[str, str]] = set()
        self._settled: set[str] = set()
        self._rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-narrator", daemon=True)

    def start(self) -> Narrator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except (ReportError, urllib.error.URLError, OSError, ValueError, KeyError):
                continue

    def poll(self) -> None:
        """One round: print alerts that started or stopped firing and actions settled since the last round."""
        alerts = self._prometheus.api("/api/v1/alerts")["alerts"]
        firing = {
            (a["labels"]["alertname"], _describe(a["labels"])): a
            for a in alerts
            if a["state"] == "firing" and a["labels"]["alertname"].startswith("Rankscope")
        }
        for key in sorted(set(firing) - self._firing):
            labels = firing[key]["labels"]
            act = f"; action {labels['action']}" if "action" in labels else ""
            self._say(f"demo: alert {key[0]} firing ({key[1]}, severity {labels.get('severity', '?')}{act})")
        for key in sorted(self._firing - set(firing)):
            self._say(f"demo: alert {key[0]} resolved ({key[1]})")
        self._firing = set(firing)
        status = self._status()
        for record in status["recent"]:
            if record["id"] in self._settled:
                continue
            self._settled.add(record["id"])
            detail = f" ({record['detail']})" if record.get("detail") else ""
            rates = ", ".join(f"{lr:.3g}" for lr in status["learning_rates"] if lr is not None)
            self._say(
                f"demo: {record['action']} from {record['reason']}: {record['status']} on all "
                f"{status['world_size']} ranks at step {record['step']}{detail}; learning rates now {rates}"
            )
        self._rounds += 1
        if firing and self._rounds % 10 == 0:  # while something fires, the loss every ten rounds
            loss = self._prometheus.scalar("run:rankscope_loss:smoothed")
            if loss is not None:
                self._say(f"demo:   run loss (2m average) {loss:.4g} at step {status['step']}")

    def _status(self) -> dict:
        """The trainer's control status (rank 0's endpoint)."""
        request = urllib.request.Request(
            f"{self._control}/v1/status", headers={"Authorization": f"Bearer {self._token}"}
        )
        with urllib.request.urlopen(request, timeout=3) as response:
            return json.loads(response.read())


def _describe(labels: dict[str, str]) -> str:
    where = f"run {labels.get('run_id', '?')}"
    if "rank" in labels:
        where += f", rank {labels['rank']}"
    return where
