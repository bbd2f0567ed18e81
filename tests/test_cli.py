"""rankscope-ctl against a real control endpoint (a ControlChannel in this process, its step
boundaries driven by a small loop thread)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest
import torch
from rankscope import Monitor, MonitorConfig, RankIdentity
from rankscope.cli import main
from rankscope.control import ControlChannel, ControlConfig
from rankscope.control.recovery import RollbackDone, RollbackRequest

from tests.support import REPO, wait_for

TOKEN = "cli-token"


class Loop:
    """A stand-in training loop: a thread calling at_step_boundary until stopped."""

    def __init__(self, channel: ControlChannel, optimizer: torch.optim.Optimizer) -> None:
        self.channel = channel
        self.optimizer = optimizer
        self.checkpoints: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def checkpoint(self, reason: str) -> bool:
        self.checkpoints.append(reason)
        return True

    def request_stop(self, reason: str) -> None:
        self._done.set()

    def rollback(self, request: RollbackRequest) -> RollbackDone:
        """Checkpoints every 10 steps: go back to the newest before the incident (the loop's own thread)."""
        checkpoint = (request.before_step - 1) // 10 * 10
        self.step = checkpoint
        return RollbackDone(checkpoint, f"step_{checkpoint}.pt", request.window(checkpoint))

    def _run(self) -> None:
        self.step = 0
        while not self._done.wait(0.01):  # a step every 10 ms
            self.step += 1
            self.optimizer.step()  # a reduced rate is applied once the optimizer steps with it
            self.channel.at_step_boundary(self.step, self)

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)


@pytest.fixture
def endpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("RANKSCOPE_CONTROL_TOKEN", TOKEN)
    monitor = Monitor(MonitorConfig(probes=()), RankIdentity.from_env({}, run_id="cli"), device="cpu")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    config = ControlConfig(port=0, lr_max_reductions=1, pause_heartbeat_seconds=0.05)
    channel = ControlChannel(config, monitor, optimizer=optimizer)
    loop = Loop(channel, optimizer)
    wait_for(lambda: channel.snapshot.read()["step"] >= 1, 10, "the loop's first step")
    monkeypatch.setenv("RANKSCOPE_CONTROL_URL", channel.url)
    yield channel, loop, optimizer
    loop.close()
    channel.close()


def test_status_prints_the_runs_status_as_json(endpoint, capsys):
    assert main(["status"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["run_id"] == "cli"
    assert status["learning_rates"] == [0.1]


def test_health_says_ok(endpoint, capsys):
    channel, _, _ = endpoint
    assert main(["health"]) == 0
    assert capsys.readouterr().out.strip() == f"{channel.url}: ok"


def test_an_action_is_posted_and_its_id_printed(endpoint, capsys):
    channel, loop, _ = endpoint
    assert main(["checkpoint", "--reason", "before upgrade", "--wait", "10"]) == 0
    captured = capsys.readouterr()
    action_id = re.search(r"^accepted checkpoint as (\S+); waiting", captured.err, re.M).group(1)
    assert captured.out.startswith(f"checkpoint {action_id}: applied at step ")
    assert loop.checkpoints == ["operator:before upgrade"]


def test_wait_exits_1_when_the_action_is_refused(endpoint, capsys):
    _, _, optimizer = endpoint
    assert main(["reduce-lr", "--factor", "0.5", "--wait", "10"]) == 0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert main(["reduce-lr", "--wait", "10"]) == 1  # lr_max_reductions=1
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"reduce_lr \S+: refused_cap at step \d+ \(reduce_lr reached its cap of 1 applications\)", last)


def test_a_wrong_token_is_a_one_line_error(endpoint, capsys, monkeypatch):
    monkeypatch.setenv("RANKSCOPE_CONTROL_TOKEN", "wrong")
    assert main(["pause"]) == 1
    assert capsys.readouterr().err == "rankscope-ctl: POST /v1/actions: 403 Forbidden: wrong bearer token\n"


def test_the_token_can_come_from_a_file(endpoint, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RANKSCOPE_CONTROL_TOKEN")
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert main(["--token-file", str(tmp_path / "token"), "status"]) == 0


def test_a_missing_token_file_is_a_one_line_error(capsys, tmp_path):
    assert main(["--token-file", str(tmp_path / "absent"), "status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rankscope-ctl: --token-file ") and "cannot read it" in err and err.count("\n") == 1


def test_an_unreachable_endpoint_is_a_one_line_error(capsys, free_port):
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "status"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["reduce-lr", "--factor", "2"], "argument --factor: must be between 0 and 1 (exclusive), got 2"),
        (["reduce-lr", "--factor", "half"], "argument --factor: must be a number, got 'half'"),
        (["explode"], "argument COMMAND: invalid choice: 'explode'"),
        (["--timeout", "-1", "status"], "argument --timeout: must be a positive number of seconds, got -1"),
        (["pause", "--wait", "soon"], "argument --wait: must be a number of seconds, got 'soon'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_flags_are_one_line_errors_with_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_url_that_is_not_http_is_a_one_line_error(capsys):
    assert main(["--url", "ftp://example", "status"]) == 1
    assert capsys.readouterr().err == "rankscope-ctl: --url must start with http:// or https://, got 'ftp://example'\n"


def test_it_runs_as_python_dash_m(endpoint):
    result = subprocess.run(
        [sys.executable, "-m", "rankscope.cli", "health"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(": ok")


def test_an_action_waits_for_its_outcome_by_default_and_a_refusal_exits_1(endpoint, capsys):
    """Without --wait the command still waits (as `kubectl rollout status` does): a refused action is not a
    success (before: `accepted reduce_lr as ...` and exit 0 for a refused_cap)."""
    assert main(["reduce-lr", "--factor", "0.5"]) == 0
    assert main(["reduce-lr"]) == 1  # lr_max_reductions=1
    captured = capsys.readouterr()
    outcomes = captured.out.splitlines()
    assert re.fullmatch(r"reduce_lr \S+: applied at step \d+( \(.*\))?", outcomes[0]), outcomes
    assert re.fullmatch(r"reduce_lr \S+: refused_cap at step \d+ \(.*cap of 1.*\)", outcomes[1]), outcomes
    assert len(re.findall(r"^accepted reduce_lr as ", captured.err, re.M)) == 2  # the acceptance: on stderr


def test_no_wait_returns_at_acceptance(endpoint, capsys):
    assert main(["checkpoint", "--no-wait"]) == 0
    assert re.fullmatch(r"accepted checkpoint as \S+", capsys.readouterr().out.strip())


def test_an_outcome_not_seen_in_time_exits_3(endpoint, capsys):
    _, loop, _ = endpoint
    loop.close()  # the loop reaches no more step boundaries: the checkpoint stays pending
    assert main(["checkpoint", "--wait", "0.5"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"rankscope-ctl: \S+ still pending after 0\.5s \(.*\)", err), err


def test_wait_and_no_wait_together_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["pause", "--wait", "5", "--no-wait"])
    assert exit_info.value.code == 2


def test_stop_waits_until_the_loop_has_left_and_prints_applied(endpoint, capsys):
    """The loop leaves, calls channel.finish(linger_seconds=...) and the command sees `applied` while the endpoint
    lingers (before: the status said pending until the endpoint closed)."""
    channel, loop, _ = endpoint
    result: dict[str, int] = {}
    command = threading.Thread(target=lambda: result.setdefault("code", main(["stop", "--reason", "done"])))
    command.start()
    loop._thread.join(timeout=30)  # the loop left at the stop's boundary
    channel.finish(linger_seconds=2.0)  # main thread: close() puts the signal handlers back
    command.join(timeout=30)
    assert result.get("code") == 0
    assert re.fullmatch(r"stop \S+: applied at step \d+", capsys.readouterr().out.strip())


def test_a_rollback_says_the_run_went_back_to_the_step_it_trains_on_from(endpoint, capsys):
    """Issue 34: 'rollback ...: applied at step 604 (took effect by step 601)' read as time running
    backwards. The outcome says the run went back."""
    channel, _, _ = endpoint
    wait_for(lambda: channel.snapshot.read()["step"] >= 25, 10, "the loop past its checkpoint at step 20")
    assert main(["rollback", "--wait", "10"]) == 0
    line = capsys.readouterr().out.strip()
    found = re.fullmatch(r"rollback \S+: applied at step (\d+) \(the run went back to step (\d+)\)", line)
    assert found is not None and int(found[2]) <= int(found[1]), line
