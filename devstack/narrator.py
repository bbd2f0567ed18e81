"""The demo's running commentary: alerts as they fire and resolve, actions as every rank applies them.

A thread of the stack launcher polls Prometheus's alerts API and the trainer's control status once a
second and prints what changed, so a person watching `make demo` sees the loop close: the fault's
alert firing, the page Alertmanager sent (to :class:`PagerSink`, a local webhook on 127.0.0.1 standing
in for compose's `pager:9095`), the action it caused applied on all ranks at one step, and the loss
over the steps just before an action that changes training against as many steps just after it (from
the trainer's run log). Every line carries its wall-clock time.

Scenarios (`make demo SCENARIO=...`) switch a fault on partway through the run, chosen so that the
shipped rules (5 s scrapes, their real `for`s) turn it into an action within the demo's minutes.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rankscope.control.stacks import fold, render
from rankscope.report.errors import ReportError
from rankscope.report.prom import Prometheus
from rankscope.report.run import label_matcher

#: The alert that names a hung rank (its `rank` label): the stack shown after a restart is that rank's.
HANG_ALERT = "RankscopeRankHung"
#: Per rank: the Unix time of its last completed step, and that step.
LAST_STEP_TIME, GLOBAL_STEP = "rankscope_last_step_timestamp_seconds", "rankscope_global_step"
#: Frames of the suspect rank's stack the demo prints after a restart (the whole file is beside the checkpoints).
STACK_FRAMES = 8
#: Frames that say how Python started the program, never why it waits.
_STARTUP_FILES = ("runpy.py",)

__all__ = [
    "LOSS_WINDOW_STEPS", "SCENARIOS", "Narrator", "PagerSink", "RunLogTail", "Scenario", "loss_windows", "stamped"
]  # fmt: skip

#: The loss "before" an action is its mean over this many logged steps up to the action's step; "after",
#: over as many steps right after it: like with like (a time window reached back to the untrained start).
LOSS_WINDOW_STEPS = 50
#: Actions that change what the model trains on or how: only these get a loss before/after line.
TRAINING_ACTIONS = frozenset({"reduce_lr", "rollback", "reduce_micro_batch"})


def stamped(line: str, at: float | None = None) -> str:
    """A narration line with its wall-clock time: `demo 04:15:02: ...`."""
    return f"demo {time.strftime('%H:%M:%S', time.localtime(time.time() if at is None else at))}: {line}"


class PagerSink:
    """Alertmanager's pager receiver in the demo: a webhook on 127.0.0.1 that says each page it gets.

    The demo's derived Alertmanager config points `pager:9095` (compose's service name, which does not
    resolve outside compose) here, so a page is shown instead of failing on a DNS lookup. With a `run_id`,
    pages of other runs (an earlier demo's, whose data Prometheus keeps in .stack/) are not said. A resolved
    notice names what the loop applied for that alert, as `fix_for` (the narrator's) tells it."""

    def __init__(
        self,
        say: Callable[[str], None],
        port: int = 0,
        run_id: str | None = None,
        fix_for: Callable[[str], str | None] | None = None,
    ) -> None:
        sink = self
        self._say = say
        self.run_id = run_id
        self.fix_for = fix_for
        """alertname -> the action the loop applied for it ("reduce_lr applied at step 371"), or None."""

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
            name = labels.get("alertname", "?")
            if alert.get("status") != "resolved":
                self._say(stamped(f"page sent: {name} firing ({_describe(labels)})"))
                continue
            fix = self.fix_for(name) if self.fix_for is not None else None
            if fix is not None:
                outcome = f": fixed by the loop: {fix}"
            elif "action" in labels:
                outcome = f": the loop applied no {labels['action']} for it"
            else:
                outcome = ""
            self._say(stamped(f"page sent: {name} resolved ({_describe(labels)}){outcome}"))

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
    # 0.30, and the rule replayed on the log fired at step 2582 (the whole demo: applied at step 2568). The
    # rollback goes back 4 minutes before the alert (its smoothing and `for`), past the spike: the fault comes
    # that much after the start, and 40 checkpoints (every 100 steps) reach that far back.
    "divergence": Scenario(
        ("faults.diverge.at_step=1500", "faults.diverge.lr_factor=9", "checkpoint.keep=40"),
        "from step 1500 the learning rate is 9x too high: the loss climbs at once, RankscopeLossDiverging "
        "fires some 2-3 minutes later (2m smoothing, then its 2m `for`) and the trainer rolls back to the newest "
        "checkpoint from before the spike and skips the data since",
    ),
    "straggler": Scenario(
        ("faults.straggler.at_step=300", "faults.straggler.rank=1", "faults.straggler.seconds=0.2"),
        "from step 300 rank 1 is 3x slower: RankscopeRankImbalance pages naming rank 1 after its 10m `for` "
        "(nothing to act on)",
    ),
    "hang": Scenario(
        ("faults.hang.at_step=300", "faults.hang.rank=1", "faults.hang.kind=data"),
        "at step 300 rank 1 blocks in its data loader for ever: RankscopeRankHung names rank 1 and its phase "
        "within about 10 s, the restart writes every rank's stacks beside the checkpoints, torchrun starts the "
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
        run_log: Path | None = None,
    ) -> None:
        self.run_id = run_id
        """The run narrated; None: the one the control endpoint serves, learned before anything is said."""
        self._prometheus, self._control, self._token = Prometheus(prometheus, timeout=3), control, token
        self._say, self._interval = say, interval
        self._firing: set[tuple[str, str]] = set()
        self._settled: set[str] = set()
        self._after: list[dict] = []  # applied actions whose loss before/after is still to say
        self._fixes: dict[str, str] = {}  # alertname -> the action last applied for it, as the pager's notice says
        # The trainer appends to its run log across launches: this run's records are those after its end now.
        self._log = RunLogTail(run_log) if run_log is not None else None
        self._rounds = 0
        self._hang_seen: float | None = None  # when this run's hang alert was seen firing, its last step not yet read
        self._hang: tuple[float, int | None] | None = None  # (time, step) of the last step before the hang
        self._stacks_dir = stacks_dir
        self._stacks_due = False  # a restart was seen and its stacks not yet said
        self._suspect: str | None = None  # the rank this run's hang alert named
        self._started = time.time()
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
        if self._hang_seen is not None:
            query = f'{{__name__=~"{LAST_STEP_TIME}|{GLOBAL_STEP}", {label_matcher("run_id", self.run_id)}}}'
            self.on_progress(
                self._prometheus.api("/api/v1/query", {"query": query, "time": f"{self._hang_seen:.3f}"})["result"]
            )
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
            if labels["alertname"] == HANG_ALERT:
                self._suspect = labels.get("rank")
                self._hang_seen = time.time()  # the last step before it is read from Prometheus as of now
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
            if record["status"] == "applied" and record["reason"].startswith("alert:"):
                self._fixes[record["reason"].removeprefix("alert:")] = (
                    f"{record['action']} applied at step {record['step']}"
                )
            if record["status"] == "applied" and record["action"] in TRAINING_ACTIONS and self._log is not None:
                self._after.append(record)
            if record["action"] == "restart":
                self._stacks_due = True
                if record["status"] == "applied" and self._hang is not None:  # settled at its first step
                    (done_at, done), self._hang = self._hang, None
                    self._say(stamped(f"  hang to training again: {at - done_at:.1f}s, from the last step before "
                                      f"the hang (step {done} at {_clock(done_at)}) to the restarted group's first "
                                      f"(step {record['step']})", at))  # fmt: skip
        if self._stacks_due:
            self._say_stacks()

    def fix_for(self, alertname: str) -> str | None:
        """The action this run's loop last applied for an alert ("reduce_lr applied at step 371"), if any."""
        return self._fixes.get(alertname)

    def _say_stacks(self) -> None:
        """The stacks the restart wrote beside the checkpoints (this run's newest): the one-line summary of
        every rank, then the innermost frames of the rank the hang alert named (else the odd one out)."""
        folder = self._stacks_dir
        files = [] if folder is None or not folder.is_dir() else folder.glob("rankscope-stacks-*.json")
        fresh = sorted((f for f in files if f.stat().st_mtime >= self._started - 1), key=lambda f: f.stat().st_mtime)
        if not fresh:
            return  # not written yet: the next round looks again
        self._stacks_due = False
        answers = {int(rank): answer for rank, answer in json.loads(fresh[-1].read_text()).items()}
        text = fresh[-1].with_suffix(".txt")
        self._say(stamped(f"stacks written before the restart: {text if text.exists() else fresh[-1]}"))
        folded = fold(answers)
        self._say(f"    {render(folded, full=False)}")
        named = int(self._suspect) if self._suspect is not None and self._suspect.isdigit() else None
        rank = named if named is not None and named in answers else folded[-1].ranks[0]
        why = "the alert's rank" if rank == named else "stacks unlike the most ranks'"
        self._say(f"  rank {rank}'s stack ({why}), innermost frame last:")
        for line in innermost_frames(answers[rank], STACK_FRAMES):
            self._say(f"    {line}")

    def on_progress(self, vector: list[dict]) -> None:
        """The hang's first sign, once its alert fired: the last step any rank completed before it, from an
        instant vector of LAST_STEP_TIME and GLOBAL_STEP as of the alert. The time to training again is
        measured from there (the user waits from the hang, not from its alert)."""
        latest = latest_step(vector)
        if self._hang_seen is None or latest is None:
            return
        alert_at, self._hang_seen, self._hang = self._hang_seen, None, latest
        self._say(stamped(f"  the hang's first sign: the last step completed was step {latest[1]} at "
                          f"{_clock(latest[0])}, {alert_at - latest[0]:.1f}s before the alert was seen"))  # fmt: skip

    def _report_loss_after(self) -> None:
        """Once the log holds the steps after an applied action: its loss over the steps before against after."""
        if not self._after or self._log is None:
            return
        records = self._log.read()
        for record in list(self._after):
            windows = loss_windows(records, record, LOSS_WINDOW_STEPS)
            if windows is None:
                continue
            self._after.remove(record)
            before, after = windows
            self._say(stamped(f"  loss around {record['action']} at step {record['step']} (rank 0's log): "
                              f"{_window_text(before)} before, {_window_text(after)} after"))  # fmt: skip

    def _status(self) -> dict:
        """The trainer's control status (rank 0's endpoint)."""
        request = urllib.request.Request(
            f"{self._control}/v1/status", headers={"Authorization": f"Bearer {self._token}"}
        )
        with urllib.request.urlopen(request, timeout=3) as response:
            return json.loads(response.read())


class RunLogTail:
    """The records the trainer appends to its JSONL run log from now on (earlier launches' are left out)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._position = path.stat().st_size if path.exists() else 0
        self._records: list[dict] = []

    def read(self) -> list[dict]:
        """Every record written since this tail began; a line still being written waits for the next call."""
        try:
            with self._path.open("rb") as log:
                log.seek(self._position)
                chunk = log.read()
        except FileNotFoundError:
            return self._records
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self._position += len(whole)
        for line in whole.decode("utf-8", "replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self._records.append(record)
        return self._records


def loss_windows(records: list[dict], action: dict, n: int) -> tuple[list[dict], list[dict]] | None:
    """The `n` train records up to a settled action's step and the `n` logged after it, in log order (after
    a rollback, the steps the run trained again); None until the log holds them.

    Steps repeat after a rollback or a restart: the action's step is its record nearest the action's own
    record in the log (the loop logs an outcome at a step boundary, its steps every log_every), and for a
    rollback the one the run went back from (the last of its rising stretch)."""
    logged = next((i for i, r in enumerate(records) if r.get("type") == "action" and r.get("id") == action["id"]), None)
    if logged is None:
        return None
    train = [(i, r) for i, r in enumerate(records) if r.get("type") == "train" and isinstance(r.get("step"), int)]
    if sum(1 for i, _ in train if i > logged) < n:
        return None  # by then the step's own record is in (an earlier run through that step may be too)
    step = action["step"]
    found = [k for k, (_, r) in enumerate(train) if r["step"] == step]
    if action["action"] == "rollback":
        found = [k for k in found if k + 1 < len(train) and train[k + 1][1]["step"] <= step]
    if not found:
        return None
    k = min(found, key=lambda k: abs(train[k][0] - logged))
    after = [r for _, r in train[k + 1 : k + 1 + n]]
    if len(after) < n:
        return None
    return [r for _, r in train[max(0, k + 1 - n) : k + 1]], after


def latest_step(vector: list[dict]) -> tuple[float, int | None] | None:
    """(time, step) of the latest step any rank completed, from an instant vector (Prometheus's
    /api/v1/query `result`) of LAST_STEP_TIME and GLOBAL_STEP; None without a completed step."""
    times: dict[str, float] = {}
    steps: dict[str, int] = {}
    for sample in vector:
        labels, value = sample["metric"], float(sample["value"][1])
        rank = labels.get("rank", "")
        if labels.get("__name__") == LAST_STEP_TIME and value > 0:
            times[rank] = value
        elif labels.get("__name__") == GLOBAL_STEP and math.isfinite(value):
            steps[rank] = int(value)
    if not times:
        return None
    rank = max(times, key=lambda r: times[r])
    return times[rank], steps.get(rank)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def innermost_frames(answer: dict, count: int) -> list[str]:
    """The main thread's innermost `count` frames of one rank's stacks answer ("pkg/file.py:12 in f: code"),
    innermost last; how Python started the program (runpy) is left out."""
    if "error" in answer:
        return [f"no stacks: {answer['error']}"]
    main = next((t for t in answer.get("threads", []) if t.get("main")), None)
    if main is None:
        return ["no main thread"]
    frames = [f for f in main["frames"] if Path(f["file"]).name not in _STARTUP_FILES][-count:]
    return [f"{'/'.join(Path(f['file']).parts[-2:]) if 'rankscope' in f['file'] else Path(f['file']).name}:"
            f"{f['line']} in {f['function']}" + (f": {f['code']}" if f.get("code") else "")
            for f in frames]  # fmt: skip


def _window_text(window: list[dict]) -> str:
    """ "0.2164 over steps 322-371" (the mean of the finite losses), with the non-finite ones counted."""
    finite = [r["loss"] for r in window if isinstance(r.get("loss"), int | float) and math.isfinite(r["loss"])]
    mean = f"{sum(finite) / len(finite):.4g}" if finite else "n/a"
    left_out = len(window) - len(finite)
    skipped = f", {left_out} non-finite left out" if left_out else ""
    return f"{mean} over steps {window[0]['step']}-{window[-1]['step']}{skipped}"


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
