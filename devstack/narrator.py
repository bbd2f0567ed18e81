"""The demo's running commentary: alerts as they fire and resolve, actions as every rank applies them.

A thread of the stack launcher polls Prometheus's alerts API and the trainer's control status once a
second and prints what changed, so a person watching `make demo` sees the loop close: the fault's
alert firing, the page Alertmanager sent (to :class:`PagerSink`, a local webhook on 127.0.0.1 standing
in for compose's `pager:9095`), the action it caused applied on all ranks at one step, and the loss in
the window before the action against the window after it. Every line carries its wall-clock time.

Scenarios (`make demo SCENARIO=...`) switch a fault on partway through the run, chosen so that the
shipped rules (5 s scrapes, their real `for`s) turn it into an action within the demo's minutes.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rankscope.report.errors import ReportError
from rankscope.report.prom import Prometheus

#: Lines of the folded stacks the demo prints after a restart (the whole file is beside the checkpoints).
STACK_LINES = 12

__all__ = ["LOSS_WINDOW_SECONDS", "SCENARIOS", "Narrator", "PagerSink", "Scenario", "stamped"]

#: The loss "before" an action is its mean over this window ending at the action; "after", over the same
#: length starting there: the untrained start of the run is in neither (a 2m average from the start was).
LOSS_WINDOW_SECONDS = 30


def stamped(line: str, at: float | None = None) -> str:
    """A narration line with its wall-clock time: `demo 04:15:02: ...`."""
    return f"demo {time.strftime('%H:%M:%S', time.localtime(time.time() if at is None else at))}: {line}"


class PagerSink:
    """Alertmanager's pager receiver in the demo: a webhook on 127.0.0.1 that says each page it gets.

    The demo's derived Alertmanager config points `pager:9095` (compose's service name, which does not
    resolve outside compose) here, so a page is shown instead of failing on a DNS lookup. With a `run_id`,
    pages of other runs (an earlier demo's, whose data Prometheus keeps in .stack/) are not said."""

    def __init__(self, say: Callable[[str], None], port: int = 0, run_id: str | None = None) -> None:
        sink = self
        self._say = say
        self.run_id = run_id

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                except ValueError:
                    body = {}
                sink.page(body)  # said before the answer: whoever posted it sees the line once answered
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, name="demo-pager", daemon=True).start()

    def page(self, payload: dict) -> None:
        """Say one line per alert of an Alertmanager webhook payload."""
        for alert in payload.get("alerts", []):
            labels = alert.get("labels", {})
            if not _of_run(labels, self.run_id):
                continue
            state = "resolved" if alert.get("status") == "resolved" else "firing"
            self._say(stamped(f"page sent: {labels.get('alertname', '?')} {state} ({_describe(labels)})"))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass(frozen=True)
class Scenario:
    """A fault for the demo and what a person should expect to see."""

    settings: tuple[str, ...]
    """Trainer `--set` overrides that switch the fault on."""
    expect: str
    """One line for the banner."""
    restarts: int = 0
    """torchrun --max-restarts for the fault (a hang's restart needs one left); the group then resumes."""

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
    "hang": Scenario(
        ("faults.hang.at_step=300", "faults.hang.rank=1", "faults.hang.kind=data"),
        "at step 300 rank 1 blocks in its data loader for ever: RankscopeRankHung names rank 1 and its phase "
        "within about 30 s, the restart writes every rank's stacks beside the checkpoints, torchrun starts the "
        "group again and it trains on from the newest checkpoint",
        restarts=1,
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
        stacks_dir: Path | None = None,
        run_id: str | None = None,
    ) -> None:
        self.run_id = run_id
        """The run narrated; None: the one the control endpoint serves, learned before anything is said."""
        self._prometheus, self._control, self._token = Prometheus(prometheus, timeout=3), control, token
        self._say, self._interval = say, interval
        self._firing: set[tuple[str, str]] = set()
        self._settled: set[str] = set()
        self._after: list[tuple[float, str, float | None]] = []  # (action time, what, loss before) to report
        self._rounds = 0
        self._stacks_dir = stacks_dir
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
        status = self._status() if self.run_id is None else None
        if status is not None:
            self.on_status(status)
        self.on_alerts(self._prometheus.api("/api/v1/alerts")["alerts"])
        self.on_status(status or self._status())
        self._report_loss_after()
        self._rounds += 1

    def on_alerts(self, alerts: list[dict]) -> None:
        """Say which of this run's alerts (Prometheus's /api/v1/alerts) started or stopped firing."""
        if self.run_id is None:
            return
        firing = {
            (a["labels"]["alertname"], _describe(a["labels"])): a
            for a in alerts
            if a["state"] == "firing"
            and a["labels"]["alertname"].startswith("Rankscope")
            and _of_run(a["labels"], self.run_id)
        }
        for key in sorted(set(firing) - self._firing):
            labels = firing[key]["labels"]
            act = f"; action {labels['action']}" if "action" in labels else ""
            self._say(stamped(f"alert {key[0]} firing ({key[1]}, severity {labels.get('severity', '?')}{act})"))
        for key in sorted(self._firing - set(firing)):
            self._say(stamped(f"alert {key[0]} resolved ({key[1]})"))
        self._firing = set(firing)

    def on_status(self, status: dict) -> None:
        """Say the actions of this run (the control endpoint's /v1/status) settled since the last call."""
        if self.run_id is None:
            self.run_id = status["run_id"]
        if status["run_id"] != self.run_id:
            return  # a trainer of another run answers on this port: its actions are not this run's
        for record in status["recent"]:
            if record["id"] in self._settled:
                continue
            self._settled.add(record["id"])
            detail = f" ({record['detail']})" if record.get("detail") else ""
            rates = ", ".join(f"{lr:.3g}" for lr in status["learning_rates"] if lr is not None)
            at = record.get("settled_at") or time.time()
            self._say(
                stamped(
                    f"{record['action']} from {record['reason']}: {record['status']} on all "
                    f"{status['world_size']} ranks at step {record['step']}{detail}; learning rates now {rates}",
                    at,
                )
            )
            if record["status"] == "applied":
                what = f"{record['action']} at step {record['step']}"
                self._after.append((at, what, self._loss_mean(at)))
            if record["action"] == "restart":
                self._say_stacks()

    def _say_stacks(self) -> None:
        """The folded stacks the restart wrote beside the checkpoints (the newest file), a few lines of them."""
        files = (
            sorted(self._stacks_dir.glob("rankscope-stacks-*.txt"), key=lambda f: f.stat().st_mtime)
            if (self._stacks_dir is not None and self._stacks_dir.is_dir())
            else []
        )
        if not files:
            return
        lines = [line for line in files[-1].read_text().splitlines() if line.strip()]
        self._say(stamped(f"stacks written before the restart: {files[-1]}"))
        for line in lines[:STACK_LINES]:
            self._say(f"    {line}")

    def _loss_mean(self, end: float) -> float | None:
        """The training loss averaged over the window ending at `end` (every rank's samples)."""
        return self._prometheus.scalar(
            f'avg(avg_over_time(rankscope_loss{{split="train"}}[{LOSS_WINDOW_SECONDS}s]))', end
        )

    def _report_loss_after(self) -> None:
        """Once a window has passed since an applied action: its loss before against after."""
        now = time.time()
        for entry in [e for e in self._after if now >= e[0] + LOSS_WINDOW_SECONDS + 5]:  # + a scrape
            self._after.remove(entry)
            at, what, before = entry
            after = self._loss_mean(at + LOSS_WINDOW_SECONDS)
            self._say(stamped(f"  loss around {what}: {loss_text(before)} in the {LOSS_WINDOW_SECONDS}s before, "
                              f"{loss_text(after)} in the {LOSS_WINDOW_SECONDS}s after (mean over ranks)"))  # fmt: skip

    def _status(self) -> dict:
        """The trainer's control status (rank 0's endpoint)."""
        request = urllib.request.Request(
            f"{self._control}/v1/status", headers={"Authorization": f"Bearer {self._token}"}
        )
        with urllib.request.urlopen(request, timeout=3) as response:
            return json.loads(response.read())


def loss_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _of_run(labels: dict[str, str], run_id: str | None) -> bool:
    """Whether an alert's labels are of the run `run_id` (None: any run)."""
    return run_id is None or labels.get("run_id") == run_id


def _describe(labels: dict[str, str]) -> str:
    where = f"run {labels.get('run_id', '?')}"
    if "rank" in labels:
        where += f", rank {labels['rank']}"
    for name in ("phase", "suspect"):  # the hang alert's: what the stuck rank is doing, and why it is the suspect
        if name in labels:
            where += f", {name} {labels[name]}"
    return where
