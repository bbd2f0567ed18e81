"""The demo's scenarios (the narrator itself is exercised end to end in tests/e2e/test_scenarios.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from rankscope_trainer.config import load_config

from devstack.narrator import SCENARIOS

REPO = Path(__file__).resolve().parents[1]


def test_every_scenario_switches_on_a_fault_the_trainer_accepts():
    for name, scenario in SCENARIOS.items():
        config = load_config("trainer/rankscope_trainer/configs/demo.yaml", list(scenario.settings))
        assert (config.faults.active() != []) == (name != "none"), name


def test_the_demos_default_run_reaches_every_scenarios_fault_with_half_the_run_left_for_its_alert():
    demo_steps = int(re.search(r"^DEMO_STEPS \?= (\d+)$", (REPO / "Makefile").read_text(), re.M).group(1))
    for name, scenario in SCENARIOS.items():
        assert scenario.fault_step is None or scenario.fault_step < demo_steps // 2, name


def test_the_demos_pager_sink_says_each_page_with_its_time():
    """Alertmanager's pager receiver in `make demo` is a local sink (compose's pager:9095 does not resolve
    there, and every page failed unseen): a real webhook POST of Alertmanager's shape is narrated."""
    import json
    import urllib.request

    from devstack.narrator import PagerSink

    lines: list[str] = []
    sink = PagerSink(lines.append)
    try:
        payload = {
            "status": "firing",
            "alerts": [
                {"status": "firing", "labels": {"alertname": "RankscopeNonFiniteSteps", "run_id": "demo", "rank": "0"}}
            ],
        }
        request = urllib.request.Request(
            sink.url + "/alerts", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        assert len(lines) == 1
        assert re.fullmatch(
            r"demo \d\d:\d\d:\d\d: page sent: RankscopeNonFiniteSteps firing \(run demo, rank 0\)", lines[0]
        )
    finally:
        sink.close()


def test_the_demo_points_alertmanagers_pager_at_its_sink():
    import argparse

    from devstack.stack import choose_ports

    args = argparse.Namespace(
        prometheus_port=None, alertmanager_port=None, control_port=None, metrics_port=None, nproc=2, pager_port=None
    )
    ports = choose_ports(args, pager=45678)
    assert ports.local("pager", 9095) == "127.0.0.1:45678"


def test_the_hang_scenario_leaves_torchrun_a_restart_and_names_the_suspect_and_its_stacks(tmp_path):
    """`make demo SCENARIO=hang`: torchrun gets a restart to spend, and the alert line names the rank, its phase
    and why it is the suspect (the stacks after the restart: the test below)."""
    import argparse

    from devstack.narrator import _describe
    from devstack.ports import Ports
    from devstack.stack import _trainer_argv

    config = REPO / "trainer/rankscope_trainer/configs/demo.yaml"
    args = argparse.Namespace(scenario="hang", nproc=2, steps=3000, overrides=[], config=config, started_at=1.0,
                              run_id="demo-hang-1")  # fmt: skip
    ports = Ports(prometheus=1, alertmanager=2, control=3, metrics=4)
    argv = _trainer_argv(args, ports, tmp_path, tmp_path / "token")
    assert "--max-restarts=1" in argv[: argv.index("rankscope_trainer")]
    assert "run.run_id=demo-hang-1" in argv  # the restarted group keeps the run_id the narration follows
    assert argv[-2:] != ["--resume", "auto"] and "auto" in argv  # the restarted group resumes ...
    assert f"checkpoint.dir={tmp_path / 'checkpoints' / 'hang-1'}" in argv  # ... from this launch's own folder
    labels = {"run_id": "demo", "rank": "1", "phase": "data_wait", "suspect": "outside_collective"}
    assert _describe(labels) == "run demo, rank 1, phase data_wait, suspect outside_collective"


# Recorded answers, in the shapes Prometheus 2.x's /api/v1/alerts and the control endpoint's /v1/status give.
def _alert(name: str, run_id: str, state: str = "firing", **labels: str) -> dict:
    return {
        "labels": {"alertname": name, "run_id": run_id, "severity": "page", **labels},
        "annotations": {"summary": f"{name} on {run_id}"},
        "state": state,
        "activeAt": "2026-12-04T05:01:02.123456789Z",
        "value": "1e+00",
    }


def _status(run_id: str, recent: list[dict]) -> dict:
    return {"run_id": run_id, "world_size": 2, "step": 620, "learning_rates": [0.0005], "paused": False,
            "paused_since": None, "stopping": False, "pending": [], "recent": recent}  # fmt: skip


def _record(action: str, step: int, reason: str, settled_at: float = 1.0, **more: object) -> dict:
    return {"id": f"a-{action}-{step}", "action": action, "source": reason.split(":")[0], "reason": reason,
            "status": "applied", "step": step, "detail": "", "settled_at": settled_at, **more}  # fmt: skip


def test_the_narration_speaks_of_this_run_only():
    """Issue 34: Prometheus's data in .stack/ outlives a demo, and the hang demo announced the previous
    run's RankscopeNonFiniteSteps. Alerts, pages and actions of another run_id are not narrated."""
    from devstack.narrator import Narrator, PagerSink

    lines: list[str] = []
    narrator = Narrator("http://127.0.0.1:1", "http://127.0.0.1:1", "t", say=lines.append, run_id="demo-hang-2")
    old = _alert("RankscopeNonFiniteSteps", "14a0c165-old", action="reduce_lr", rank="0")
    narrator.on_alerts([old, _alert("RankscopeRankHung", "demo-hang-2", rank="1", phase="data_wait", action="restart")])
    assert len(lines) == 1 and "RankscopeRankHung firing (run demo-hang-2, rank 1" in lines[0], lines
    narrator.on_alerts([])  # both gone: only this run's is said to resolve
    assert len(lines) == 2 and "alert RankscopeRankHung resolved (run demo-hang-2" in lines[1], lines
    narrator.on_status(_status("14a0c165-old", [_record("reduce_lr", 371, "alert:RankscopeNonFiniteSteps")]))
    assert len(lines) == 2, lines  # another run's control status (a trainer of an earlier launch) is not this run
    mine = _record("pause", 640, "operator:demo", status="noop", detail="already paused")
    narrator.on_status(_status("demo-hang-2", [mine]))
    assert len(lines) == 3 and "pause from operator:demo: noop on all 2 ranks at step 640" in lines[2], lines

    paged: list[str] = []
    sink = PagerSink(paged.append, run_id="demo-hang-2")
    try:
        page = {"status": "firing", "labels": {"alertname": "RankscopeNonFiniteSteps", "run_id": "14a0c165-old"}}
        sink.page({"version": "4", "status": "firing", "receiver": "pager", "alerts": [page]})
        assert paged == []
    finally:
        sink.close()


def test_without_a_run_id_the_narrator_takes_the_one_its_control_endpoint_serves():
    from devstack.narrator import Narrator

    lines: list[str] = []
    narrator = Narrator("http://127.0.0.1:1", "http://127.0.0.1:1", "t", say=lines.append)
    narrator.on_status(_status("run-a", []))
    narrator.on_alerts([_alert("RankscopeRankHung", "run-b", rank="1"), _alert("RankscopeRankHung", "run-a", rank="0")])
    assert len(lines) == 1 and "run run-a, rank 0" in lines[0], lines


class _Loop:
    """Writes the run log as the reference trainer's loop does: each step recorded, flushed every 10 steps
    at a boundary, then the settled outcomes of /v1/status logged (trainer/rankscope_trainer/loop.py)."""

    def __init__(self, path):
        from rankscope_trainer.logbook import ProgressLog

        self.log = ProgressLog(str(path), enabled=True, max_steps=10_000, samples_per_step=8)
        self.recent: list[dict] = []

    def train(self, steps, loss):
        import torch

        for step in steps:
            self.log.record_step(step, torch.tensor(loss(step)), torch.tensor([0.5, 0.5]), 1e-3)
            if step % 10 == 0:
                self.log.flush()
            self.log.actions(self.recent)


def test_the_loss_around_an_action_compares_as_many_steps_before_as_after_and_says_which(tmp_path):
    """Issue 34: 'loss 1.008 in the 30 s before, 0.154 after' reached back to the untrained start of the
    run, and a checkpoint got the same line. Now: the N logged steps up to the action's step against the N
    after it, named; nothing for an action that does not change training; an earlier launch's log is not read."""
    from devstack.narrator import LOSS_WINDOW_STEPS as N
    from devstack.narrator import Narrator

    path = tmp_path / "log.jsonl"
    earlier = _Loop(path)  # an earlier demo appended to the same log: reduce_lr at the same step, other losses
    earlier.recent = [_record("reduce_lr", 371, "alert:x")]  # ids are not unique across launches
    earlier.train(range(1, 500), lambda step: 9.0)
    lines: list[str] = []
    narrator = Narrator("http://127.0.0.1:1", "http://127.0.0.1:1", "t", say=lines.append, run_id="r", run_log=path)
    loop = _Loop(path)
    loop.train(range(1, 301), lambda step: 5.0 - step / 100)  # falling from the untrained start
    loop.train(range(301, 306), lambda step: float("nan"))  # the fault: skipped steps
    loop.train(range(306, 372), lambda step: 0.3)
    reduce_lr, checkpoint = _record("reduce_lr", 371, "alert:x"), _record("checkpoint", 371, "alert:y", id="c")
    loop.recent = [reduce_lr, checkpoint]
    narrator.on_status(_status("r", loop.recent))
    narrator._report_loss_after()
    loop.train(range(372, 372 + N - 1), lambda step: 0.1)
    narrator._report_loss_after()
    assert not any("loss around" in line for line in lines)  # not yet N steps after it
    loop.train(range(372 + N - 1, 372 + N + 20), lambda step: 0.1)
    narrator._report_loss_after()
    said = [line.split(": ", 1)[1] for line in lines if "loss around" in line]
    assert said == [f"  loss around reduce_lr at step 371 (rank 0's log): 0.3 over steps {372 - N}-371 before, "
                    f"0.1 over steps 372-{371 + N} after"], lines  # fmt: skip


def test_the_loss_after_a_rollback_is_of_the_steps_trained_again(tmp_path):
    """A rollback applied at step 604 took the run back to the checkpoint of step 600: the steps before are
    601..604 as first trained, those after are 601.. as trained again, in log order."""
    from devstack.narrator import loss_windows

    path = tmp_path / "log.jsonl"
    loop = _Loop(path)
    loop.train(range(551, 605), lambda step: 2.0)
    loop.log.flush()  # the loop writes the steps before the rollback's record (loop.py, _rollback)
    rollback = _record("rollback", 604, "alert:RankscopeLossDiverging", detail="the run went back to step 601")
    loop.recent = [rollback]
    loop.train(range(601, 700), lambda step: 1.0)

    before, after = loss_windows(_read(path), rollback, 20)
    assert [r["step"] for r in before] == list(range(585, 605)) and {r["loss"] for r in before} == {2.0}
    assert [r["step"] for r in after] == list(range(601, 621)) and {r["loss"] for r in after} == {1.0}


def _read(path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def _frames(*where: tuple[str, int, str, str]) -> list[dict]:
    return [{"file": file, "line": line, "function": function, "code": code} for file, line, function, code in where]


def test_after_a_hang_the_narration_shows_the_stack_of_the_rank_the_alert_named(tmp_path):
    """Issue 34: the narrated excerpt was the healthy rank 0's (runpy frames, cut off); the hung rank's stack
    was only in the file. Now the alert's rank (written by the restart as rankscope.control.stacks does):
    its innermost frames, innermost last, runpy's left out."""
    import sysconfig

    from rankscope.control.stacks import write_stacks

    from devstack.narrator import STACK_FRAMES, Narrator

    stdlib = sysconfig.get_paths()["stdlib"]  # where this Python's runpy and threading are
    runpy = [(f"{stdlib}/runpy.py", 198, "_run_module_as_main", "return _run_code(code, main_globals)"),
             (f"{stdlib}/runpy.py", 88, "_run_code", "exec(code, run_globals)")]  # fmt: skip
    train = [("/work/trainer/rankscope_trainer/__main__.py", 4, "<module>", "main()"),
             ("/work/trainer/rankscope_trainer/loop.py", 230, "train", "batch = self.data.next()")]  # fmt: skip
    healthy = _frames(*runpy, *train, ("/work/venv/torch/distributed/distributed_c10d.py", 2950, "all_reduce", "w()"))
    hung = _frames(*runpy, *train, *[("/work/trainer/rankscope_trainer/data.py", 100 + i, f"fetch{i}", "") for i in
                                     range(STACK_FRAMES)],  # fmt: skip
                   ("/work/trainer/rankscope_trainer/faults.py", 120, "block_forever", "self._never.wait()"),
                   (f"{stdlib}/threading.py", 359, "wait", "waiter.acquire()"))  # fmt: skip
    answers = {r: {"rank": r, "pid": 1, "time": 0.0, "threads": [{"thread": "MainThread", "main": True, "daemon": False,
               "frames": frames}]} for r, frames in ((0, healthy), (1, hung), (2, healthy))}  # fmt: skip
    write_stacks(tmp_path, answers, "restart-1")

    lines: list[str] = []
    narrator = Narrator(
        "http://127.0.0.1:1", "http://127.0.0.1:1", "t", say=lines.append, stacks_dir=tmp_path, run_id="r"
    )
    narrator.on_alerts([_alert("RankscopeRankHung", "r", rank="1", phase="data_wait", action="restart")])
    narrator.on_status(_status("r", [_record("restart", 300, "alert:RankscopeRankHung", detail="stacks written")]))
    text = "\n".join(lines)
    assert "ranks 0, 2: all_reduce in distributed_c10d.py:2950; rank 1: block_forever in faults.py:120" in text
    excerpt = text[text.index("rank 1's stack (the alert's rank)") :].splitlines()[1:]
    assert len(excerpt) == STACK_FRAMES and "runpy" not in text, text
    assert excerpt[-1] == "    threading.py:359 in wait: waiter.acquire()"
    assert excerpt[-2] == "    rankscope_trainer/faults.py:120 in block_forever: self._never.wait()"


def _vector(run_id: str, at: float, *ranks: tuple[str, float, int]) -> list[dict]:
    """Prometheus's /api/v1/query `result` for rankscope_last_step_timestamp_seconds and rankscope_global_step."""
    out = []
    for rank, done_at, step in ranks:
        labels = {"instance": f"127.0.0.1:940{rank}", "job": "rankscope", "rank": rank, "run_id": run_id}
        out.append({"metric": {"__name__": "rankscope_last_step_timestamp_seconds", **labels},
                    "value": [at, repr(done_at)]})  # fmt: skip
        out.append({"metric": {"__name__": "rankscope_global_step", **labels}, "value": [at, str(step)]})
    return out


def test_a_hang_is_timed_from_its_last_completed_step_to_the_restarted_groups_first():
    """Issue 34: the hang was timed from its alert (8.9 s) while the user waited some 30 s from the hang to
    training again. The narration now times it from the last step any rank completed (Prometheus, as of the
    alert) to the restart's settling, which the restarted group's first step does (rankscope.control.restart)."""
    from devstack.narrator import Narrator

    lines: list[str] = []
    narrator = Narrator("http://127.0.0.1:1", "http://127.0.0.1:1", "t", say=lines.append, run_id="r")
    narrator.on_alerts([_alert("RankscopeRankHung", "r", rank="1", phase="data_wait", action="restart")])
    last = time.time() - 31.0  # rank 0 waits in the all-reduce of the step rank 1 never joins
    narrator.on_progress(_vector("r", time.time(), ("0", last, 299), ("1", last - 0.08, 299)))
    assert re.search(r": {3}the hang's first sign: the last step completed was step 299 at \d\d:\d\d:\d\d, 3\d\.\ds "
                     r"before the alert was seen$", lines[-1]), lines  # fmt: skip
    restart = _record("restart", 201, "alert:RankscopeRankHung", settled_at=last + 42.5,
                      detail="the restarted group trained step 201 from step 200; 99 step(s) ... lost")  # fmt: skip
    narrator.on_status(_status("r", [restart]))
    said = [line for line in lines if "hang to training again" in line]
    assert len(said) == 1 and said[0].endswith(
        f": 42.5s, from the last step before the hang (step 299 at {time.strftime('%H:%M:%S', time.localtime(last))}) "
        "to the restarted group's first (step 201)"
    ), lines


def _webhook(status: str, labels: dict, ends_at: str = "0001-01-01T00:00:00Z") -> dict:
    """An Alertmanager webhook body (version 4) for one alert, as the pager receiver gets it."""
    return {
        "version": "4",
        "groupKey": f'{{}}/{{severity="page"}}:{{alertname="{labels["alertname"]}", run_id="{labels["run_id"]}"}}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "pager",
        "groupLabels": {"alertname": labels["alertname"], "run_id": labels["run_id"]},
        "commonLabels": labels,
        "commonAnnotations": {"summary": "non-finite loss on rank 0"},
        "externalURL": "http://127.0.0.1:9093",
        "alerts": [
            {
                "status": status,
                "labels": labels,
                "annotations": {"summary": "non-finite loss on rank 0"},
                "startsAt": "2026-12-04T05:01:02.123Z",
                "endsAt": ends_at,
                "generatorURL": "http://127.0.0.1:9090/graph?g0.expr=...",
                "fingerprint": "c2a1a1d34d0e8f3b",
            }
        ],
    }


def _post(url: str, body: dict) -> int:
    import json
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status


def test_the_pager_says_the_page_then_the_resolved_notice_naming_the_loops_fix():
    """Issue 34: for an incident the loop fixed by itself the on-call story is a page, then a resolved
    notice. The pager sink says both; the notice names the action the loop applied for that alert."""
    from devstack.narrator import Narrator, PagerSink

    lines: list[str] = []
    narrator = Narrator("http://127.0.0.1:1", "http://127.0.0.1:1", "t", say=lines.append, run_id="r")
    sink = PagerSink(lines.append, run_id="r", fix_for=narrator.fix_for)
    labels = {"alertname": "RankscopeNonFiniteSteps", "run_id": "r", "rank": "0", "severity": "page",
              "action": "reduce_lr"}  # fmt: skip
    try:
        assert _post(sink.url + "/", _webhook("firing", labels)) == 200
        narrator.on_status(_status("r", [_record("reduce_lr", 371, "alert:RankscopeNonFiniteSteps")]))
        assert _post(sink.url + "/", _webhook("resolved", labels, "2026-12-04T05:03:40.5Z")) == 200
        other = {**labels, "alertname": "RankscopeRankImbalance", "action": "checkpoint"}  # nothing applied for it
        assert _post(sink.url + "/", _webhook("resolved", other, "2026-12-04T05:03:40.5Z")) == 200
    finally:
        sink.close()
    pages = [line.split(": ", 1)[1] for line in lines if "page sent" in line]
    assert pages == [
        "page sent: RankscopeNonFiniteSteps firing (run r, rank 0)",
        "page sent: RankscopeNonFiniteSteps resolved (run r, rank 0): fixed by the loop: reduce_lr applied at step 371",
        "page sent: RankscopeRankImbalance resolved (run r, rank 0): the loop applied no checkpoint for it",
    ], lines
