"""ControlChannel: one process without torch.distributed, then a real 2-rank torchrun job driven
through every action, checked on both ranks."""

from __future__ import annotations

import math
import re
import threading
import time

import pytest
import requests
import torch
from rankscope import Monitor, MonitorConfig, NullMonitor, RankIdentity
from rankscope.control import ControlChannel, ControlConfig, ControlPortInUse, ControlStartError
from rankscope.control.actions import ActionRequest
from rankscope.control.recovery import ActionUnavailable, MicroBatchChange, RollbackDone, RollbackRequest

from tests.support import fetch, sample_value, samples, wait_for

TOKEN = "channel-token"


class LoopHandler:
    """What a training loop hands the channel: it notes checkpoints and stop requests."""

    def __init__(self, fail_checkpoints: bool = False) -> None:
        self.checkpoints: list[str] = []
        self.stop_reason: str | None = None
        self.fail_checkpoints = fail_checkpoints

    def checkpoint(self, reason: str) -> bool:
        if self.fail_checkpoints:
            raise OSError("disk full")
        self.checkpoints.append(reason)
        return True

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason


@pytest.fixture
def monitor():
    return Monitor(MonitorConfig(probes=()), RankIdentity.from_env({}, run_id="unit"), device="cpu")


@pytest.fixture
def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


@pytest.fixture
def make_channel(monitor, optimizer, monkeypatch):
    monkeypatch.setenv("RANKSCOPE_CONTROL_TOKEN", TOKEN)
    channels = []

    def make(**settings) -> ControlChannel:
        config = ControlConfig(**{"port": 0, "lr_cooldown_seconds": 0.0, **settings})
        channel = ControlChannel(config, monitor, optimizer=optimizer)
        channels.append(channel)
        return channel

    yield make
    for channel in channels:
        channel.close()


def post(channel, action, **params):
    body = {"action": action, "reason": "unit", **({"params": params} if params else {})}
    response = requests.post(
        channel.url + "/v1/actions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
    )
    assert response.status_code == 202, response.text
    return response.json()["id"]


def recent(channel):
    return {r["id"]: r for r in channel.queue.snapshot()["recent"]}


def actions_total(monitor, action, source, result):
    labels = {**monitor.identity.labels(), "action": action, "source": source, "result": result}
    return monitor.registry.get_sample_value("rankscope_control_actions_total", labels) or 0


# --- one process -------------------------------------------------------------------------


def test_without_a_token_the_channel_refuses_to_start(monitor, monkeypatch):
    monkeypatch.delenv("RANKSCOPE_CONTROL_TOKEN", raising=False)
    with pytest.raises(ControlStartError, match="needs a bearer token: set control.token_file or the"):
        ControlChannel(ControlConfig(port=0), monitor)


def test_an_insecure_channel_starts_without_a_token(monitor, monkeypatch, caplog):
    monkeypatch.delenv("RANKSCOPE_CONTROL_TOKEN", raising=False)
    with caplog.at_level("WARNING", logger="rankscope"):
        channel = ControlChannel(ControlConfig(port=0, insecure=True), monitor)
    try:
        assert requests.get(channel.url + "/v1/status", timeout=5).status_code == 200
        assert "WITHOUT a token" in caplog.text
    finally:
        channel.close()


def test_an_insecure_endpoint_on_every_interface_says_so(monitor, monkeypatch, caplog):
    # Anyone who can reach the port can act on the run: the warning must say how far that reaches.
    monkeypatch.delenv("RANKSCOPE_CONTROL_TOKEN", raising=False)
    with caplog.at_level("WARNING", logger="rankscope"):
        channel = ControlChannel(ControlConfig(host="0.0.0.0", port=0, insecure=True), monitor)
    try:
        assert "0.0.0.0:" in caplog.text and "(every interface) WITHOUT a token" in caplog.text
    finally:
        channel.close()


def test_a_taken_port_fails_with_the_setting_named(make_channel):
    first = make_channel()
    with pytest.raises(ControlStartError, match="already in use; stop the other process or change control.port"):
        make_channel(port=int(first.url.rsplit(":", 1)[1]))
    assert issubclass(ControlPortInUse, RuntimeError)


def test_the_endpoint_binds_loopback_by_default(make_channel):
    assert make_channel().url.startswith("http://127.0.0.1:")


def test_a_disabled_channel_serves_nothing_and_applies_nothing(monitor):
    channel = ControlChannel(ControlConfig(enabled=False), monitor)
    assert channel.url is None
    assert channel.at_step_boundary(1, LoopHandler()) == []
    channel.close()


def test_a_reduction_is_applied_once_the_optimizer_stepped_with_the_reduced_rate(make_channel, monitor, optimizer):
    channel = make_channel()
    handler = LoopHandler()
    action_id = post(channel, "reduce_lr", lr_factor=0.25)
    assert channel.queue.snapshot()["pending"][0]["id"] == action_id
    assert channel.at_step_boundary(7, handler) == ["reduce_lr"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    # Carried out, but not yet used by the optimizer: still pending, saying what it waits for.
    (pending,) = channel.queue.snapshot()["pending"]
    assert pending["id"] == action_id and "next optimizer step" in pending["detail"]
    assert channel.snapshot.read()["learning_rates"] == pytest.approx([0.025])
    optimizer.step()
    channel.at_step_boundary(8, handler)
    record = recent(channel)[action_id]
    assert (record["status"], record["step"], record["detail"]) == ("applied", 7, "took effect by step 8")
    assert actions_total(monitor, "reduce_lr", "operator", "applied") == 1
    assert channel.lr_scale == 0.25


def test_a_reduction_the_loop_overwrites_is_overridden_and_uses_no_cap_or_cooldown(
    make_channel, monitor, optimizer, caplog
):
    channel = make_channel(lr_max_reductions=1, lr_cooldown_steps=100)
    handler = LoopHandler()
    first = post(channel, "reduce_lr")
    channel.at_step_boundary(1, handler)
    optimizer.param_groups[0]["lr"] = 0.1  # a hand-written LR function, ignoring the reduction
    with caplog.at_level("WARNING", logger="rankscope"):
        optimizer.step()
        channel.at_step_boundary(2, handler)
    record = recent(channel)[first]
    assert record["status"] == "overridden"
    assert "overwrote the reduced learning rate" in record["detail"] and "lr_scale" in record["detail"]
    assert "overridden" in caplog.text
    assert actions_total(monitor, "reduce_lr", "operator", "overridden") == 1
    assert actions_total(monitor, "reduce_lr", "operator", "applied") == 0
    assert channel.lr_scale == 1.0  # taken back
    # Neither the cap of 1 nor the 100-step cooldown was used: a second request is carried out, and a
    # loop that multiplies in lr_scale (the README's recipe) gets it applied.
    second = post(channel, "reduce_lr")
    channel.at_step_boundary(3, handler)
    optimizer.param_groups[0]["lr"] = 0.1 * channel.lr_scale
    optimizer.step()
    channel.at_step_boundary(4, handler)
    assert recent(channel)[second]["status"] == "applied"
    assert channel.lr_scale == 0.5


@pytest.mark.parametrize("honour", [True, False], ids=["recipe", "overwrite"])
def test_a_reduction_during_a_steep_warmup_is_judged_by_where_the_schedule_goes(make_channel, optimizer, honour):
    # nanoGPT's warmup sets lr * (it + 1) / (warmup + 1) at the top of each iteration: the rate doubles from
    # iteration 0 to 1 and grows by 1/3 to 2. Judged against the last rate alone, a halved rate that the
    # loop honours (2 * 0.5 = 1x the last) would look overwritten; judged against where the schedule goes,
    # the recipe is applied and an overwrite is still caught.
    channel = make_channel()
    handler = LoopHandler()

    def warmup(it: int) -> float:
        return 0.1 * (it + 1) / 11

    for it in range(2):
        optimizer.param_groups[0]["lr"] = warmup(it)
        optimizer.step()
        channel.at_step_boundary(it + 1, handler)
    action_id = post(channel, "reduce_lr", lr_factor=0.5)
    channel.at_step_boundary(2, handler)
    optimizer.param_groups[0]["lr"] = warmup(2) * (channel.lr_scale if honour else 1.0)
    optimizer.step()
    channel.at_step_boundary(3, handler)
    assert recent(channel)[action_id]["status"] == ("applied" if honour else "overridden")


def test_no_factor_takes_a_rate_below_its_floor_relative_to_the_starting_rate(make_channel, optimizer):
    channel = make_channel()
    action_id = post(channel, "reduce_lr", lr_factor=1e-300)
    channel.at_step_boundary(1, LoopHandler())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 1e-3)  # lr_floor_ratio of the starting 0.1
    assert channel.lr_scale == pytest.approx(1e-3)
    optimizer.step()
    channel.at_step_boundary(2, LoopHandler())
    assert recent(channel)[action_id]["status"] == "applied"
    refused = post(channel, "reduce_lr")
    channel.at_step_boundary(3, LoopHandler())
    assert recent(channel)[refused]["status"] == "refused_floor"


def test_the_control_state_survives_a_checkpoint(make_channel, optimizer, monitor):
    channel = make_channel(lr_max_reductions=1)
    post(channel, "reduce_lr")
    channel.at_step_boundary(1, LoopHandler())
    optimizer.step()
    channel.at_step_boundary(2, LoopHandler())
    state = channel.state_dict()
    channel.close()
    resumed = make_channel(lr_max_reductions=1)
    resumed.load_state_dict(state)
    assert resumed.lr_scale == 0.5
    capped = post(resumed, "reduce_lr")
    resumed.at_step_boundary(3, LoopHandler())
    assert recent(resumed)[capped]["status"] == "refused_cap"  # the cap counts the run, not the process
    with pytest.raises(ValueError, match="control state has format"):
        resumed.load_state_dict({"format": 99})


def cosine_scheduler(optimizer, steps=1000):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))


def train(channel, optimizer, scheduler, handler, steps):
    """`steps` optimizer steps, each followed by the scheduler's and the step boundary."""
    for step in steps:
        optimizer.step()
        scheduler.step()
        channel.at_step_boundary(step, handler)


def test_a_reduction_for_a_number_of_steps_gives_the_schedules_rate_back_after_them(monitor, make_channel, caplog):
    # A transient burst of non-finite steps must not cost the rest of the run half its rate: the rule pack's
    # reduce_lr lasts restore_after_steps, and then the cosine schedule goes on exactly where it would have.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = cosine_scheduler(optimizer)
    unreduced_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    unreduced = cosine_scheduler(unreduced_optimizer)
    channel = ControlChannel(ControlConfig(port=0, lr_cooldown_seconds=0.0), monitor, optimizer, scheduler)
    try:
        handler = LoopHandler()
        action_id = post(channel, "reduce_lr", lr_factor=0.5, restore_after_steps=20)
        train(channel, optimizer, scheduler, handler, range(1, 11))
        assert recent(channel)[action_id]["status"] == "applied"
        for _ in range(10):
            unreduced_optimizer.step()
            unreduced.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * unreduced.get_last_lr()[0])
        assert channel.lr_scale == 0.5
        assert channel.state_dict()["lr_return"]["due_step"] == 21  # reduced at step 1
        with caplog.at_level("WARNING", logger="rankscope"):
            train(channel, optimizer, scheduler, handler, range(11, 22))
        for _ in range(11):
            unreduced_optimizer.step()
            unreduced.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(unreduced.get_last_lr()[0])
        assert scheduler.base_lrs == pytest.approx([0.1])
        assert channel.lr_scale == 1.0
        assert channel.snapshot.read()["learning_rates"] == pytest.approx(unreduced.get_last_lr())
        assert "learning rates given back at step 21, 20 steps after the reduction at step 1" in caplog.text
        assert channel.state_dict()["lr_return"] is None
        optimizer.step()
        scheduler.step()
        unreduced_optimizer.step()
        unreduced.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(unreduced.get_last_lr()[0])  # the schedule keeps it
    finally:
        channel.close()


def test_reductions_for_a_number_of_steps_are_given_back_together_and_one_for_good_stays(make_channel, optimizer):
    channel = make_channel()
    handler = LoopHandler()

    def reduce(step, **params):
        post(channel, "reduce_lr", **params)
        channel.at_step_boundary(step, handler)
        optimizer.step()

    reduce(1, lr_factor=0.5, restore_after_steps=10)
    reduce(2, lr_factor=0.5)  # for good
    reduce(5, lr_factor=0.5, restore_after_steps=10)  # the return of both moves to step 15
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0125) and channel.lr_scale == 0.125
    for step in range(6, 15):
        channel.at_step_boundary(step, handler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0125)
    channel.at_step_boundary(15, handler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and channel.lr_scale == 0.5


def test_a_control_configs_lr_restore_after_steps_is_every_reductions_default(make_channel, optimizer):
    channel = make_channel(lr_restore_after_steps=3)
    action_id = post(channel, "reduce_lr")
    channel.at_step_boundary(1, LoopHandler())
    assert channel.queue.snapshot()["pending"][0]["id"] == action_id
    optimizer.step()
    for step in range(2, 5):
        channel.at_step_boundary(step, LoopHandler())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="control.lr_restore_after_steps must be"):
        ControlConfig(lr_restore_after_steps=-1)


def test_nothing_is_given_back_before_the_reduction_is_judged(make_channel, optimizer):
    # The optimizer has not stepped with the reduced rate yet (gradient accumulation): giving it back first
    # would have the reduction judged against a rate it never set.
    channel = make_channel()
    action_id = post(channel, "reduce_lr", restore_after_steps=1)
    for step in range(1, 4):
        channel.at_step_boundary(step, LoopHandler())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    optimizer.step()
    channel.at_step_boundary(4, LoopHandler())
    assert recent(channel)[action_id]["status"] == "applied"
    channel.at_step_boundary(5, LoopHandler())  # the first boundary after it was judged
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_a_rollback_keeps_the_rates_it_loads_and_drops_what_was_owed(make_channel, optimizer, caplog):
    # The rates come back from the checkpoint, reduced or not: giving the reduction back on top of rates from
    # before it would double them.
    channel = make_channel(rollback_cooldown_seconds=0.0)
    loop = RecoveringLoop()
    post(channel, "reduce_lr", restore_after_steps=100)
    channel.at_step_boundary(35, loop)
    optimizer.step()
    post(channel, "rollback")
    with caplog.at_level("WARNING", logger="rankscope"):
        channel.at_step_boundary(36, loop)
    assert "drops the learning rates owed back at step 135" in caplog.text
    optimizer.param_groups[0]["lr"] = 0.1  # the checkpoint of step 30, from before the reduction
    for step in range(31, 140):
        channel.at_step_boundary(step, loop)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_what_is_owed_back_survives_a_checkpoint_and_an_older_checkpoint_owes_nothing(make_channel, optimizer):
    channel = make_channel()
    post(channel, "reduce_lr", restore_after_steps=10)
    channel.at_step_boundary(1, LoopHandler())
    optimizer.step()
    channel.at_step_boundary(2, LoopHandler())
    state = channel.state_dict()
    channel.close()
    resumed = make_channel()
    resumed.load_state_dict(state)
    for step in range(3, 12):
        resumed.at_step_boundary(step, LoopHandler())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1) and resumed.lr_scale == 1.0
    older = {key: value for key, value in state.items() if key != "lr_return"} | {"format": 1, "lr_scale": 1.0}
    resumed.load_state_dict(older)  # a checkpoint of the previous format
    assert resumed.state_dict()["lr_return"] is None
    with pytest.raises(ValueError, match="lr_return would lower a rate"):
        resumed.load_state_dict(state | {"lr_return": state["lr_return"] | {"ratios": [0.5]}})
    with pytest.raises(ValueError, match="lr_return has 2 param groups, the optimizer 1"):
        resumed.load_state_dict(state | {"lr_return": state["lr_return"] | {"ratios": [2.0, 2.0]}})


def test_a_checkpoint_passes_its_reason_to_the_loop(make_channel):
    channel = make_channel()
    handler = LoopHandler()
    post(channel, "checkpoint")
    channel.at_step_boundary(3, handler)
    assert handler.checkpoints == ["operator:unit"]


def test_refusals_by_cooldown_cap_and_floor_are_visible_in_status_and_metrics(make_channel, monitor, optimizer):
    channel = make_channel(lr_cooldown_steps=10, lr_max_reductions=2, lr_floor=0.02)
    handler = LoopHandler()
    first, too_soon = post(channel, "reduce_lr"), post(channel, "reduce_lr")
    channel.at_step_boundary(1, handler)
    optimizer.step()
    second = post(channel, "reduce_lr")
    channel.at_step_boundary(11, handler)
    optimizer.step()
    capped = post(channel, "reduce_lr")
    channel.at_step_boundary(30, handler)
    outcomes = recent(channel)
    assert [outcomes[i]["status"] for i in (first, too_soon, second, capped)] == [
        "applied",
        "refused_cooldown",
        "applied",
        "refused_cap",
    ]
    assert "cooldown is 10 steps" in outcomes[too_soon]["detail"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    assert actions_total(monitor, "reduce_lr", "operator", "refused_cooldown") == 1
    assert actions_total(monitor, "reduce_lr", "operator", "refused_cap") == 1


def test_reduce_lr_at_the_floor_is_refused(make_channel, optimizer):
    channel = make_channel(lr_floor=0.1)
    action_id = post(channel, "reduce_lr")
    channel.at_step_boundary(1, LoopHandler())
    assert recent(channel)[action_id]["status"] == "refused_floor"
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_actions_wait_for_a_step_divisible_by_check_every_n_steps(make_channel):
    channel = make_channel(check_every_n_steps=5)
    handler = LoopHandler()
    post(channel, "checkpoint")
    for step in range(1, 5):
        assert channel.at_step_boundary(step, handler) == []
    assert handler.checkpoints == []
    assert channel.at_step_boundary(5, handler) == ["checkpoint"]
    assert channel.snapshot.read()["step"] == 5


def test_a_checkpoint_the_loop_did_not_write_is_failed(make_channel, monitor):
    class Forgetful(LoopHandler):
        def checkpoint(self, reason: str) -> None:
            self.checkpoints.append(reason)  # and returns None: nothing was written

    channel = make_channel()
    action_id = post(channel, "checkpoint")
    channel.at_step_boundary(2, Forgetful())
    record = recent(channel)[action_id]
    assert record["status"] == "failed" and "no checkpoint was written" in record["detail"]


def test_a_checkpoint_written_later_is_applied_when_the_loop_says_so(make_channel):
    written = []

    class Deferred(LoopHandler):
        def checkpoint(self, reason: str):
            return lambda: True if written else None

    channel = make_channel()
    action_id = post(channel, "checkpoint")
    channel.at_step_boundary(2, Deferred())
    channel.at_step_boundary(3, Deferred())
    assert channel.queue.snapshot()["pending"][0]["id"] == action_id
    written.append("checkpoint-3")
    channel.at_step_boundary(4, Deferred())
    assert recent(channel)[action_id]["status"] == "applied"


def test_a_failing_checkpoint_is_reported_failed_and_the_loop_goes_on(make_channel, monitor):
    channel = make_channel()
    action_id = post(channel, "checkpoint")
    assert channel.at_step_boundary(2, LoopHandler(fail_checkpoints=True)) == []
    record = recent(channel)[action_id]
    assert record["status"] == "failed"
    assert "OSError: disk full" in record["detail"]
    assert actions_total(monitor, "checkpoint", "operator", "failed") == 1


# --- recovery actions: the handler contract (exporter/rankscope/control/recovery.py) ----------------------------


class RecoveringLoop(LoopHandler):
    """A loop that implements rollback and reduce_micro_batch, with checkpoints at steps 10, 20 and 30."""

    def __init__(self, micro_batch: int = 16) -> None:
        super().__init__()
        self.requests: list[RollbackRequest] = []
        self.micro_batch, self.accumulation = micro_batch, 1

    def rollback(self, request: RollbackRequest) -> RollbackDone:
        self.requests.append(request)
        found = [step for step in (10, 20, 30) if step < request.before_step]
        if not found:
            raise ActionUnavailable(f"no checkpoint before step {request.before_step}")
        return RollbackDone(found[-1], f"step_{found[-1]}.pt", request.window(found[-1]))

    def reduce_micro_batch(self, reason: str) -> MicroBatchChange:
        if self.micro_batch < 4:
            raise ActionUnavailable(f"a micro-batch of {self.micro_batch} cannot be halved")
        before = (self.micro_batch, self.accumulation)
        self.micro_batch, self.accumulation = self.micro_batch // 2, self.accumulation * 2
        return MicroBatchChange(self.micro_batch, self.accumulation, *before)


def test_a_loop_without_the_recovery_methods_gets_unsupported_and_keeps_its_cap(make_channel, monitor):
    channel = make_channel(rollback_max=1, rollback_cooldown_seconds=0.0)
    ids = [post(channel, "rollback"), post(channel, "reduce_micro_batch")]
    channel.at_step_boundary(35, LoopHandler())
    records = recent(channel)
    assert [records[i]["status"] for i in ids] == ["unsupported", "unsupported"]
    assert "has no rollback() method" in records[ids[0]]["detail"]
    assert actions_total(monitor, "rollback", "operator", "unsupported") == 1
    loop = RecoveringLoop()
    again = post(channel, "rollback")  # the unsupported one used no cap
    channel.at_step_boundary(36, loop)
    assert again not in recent(channel)  # settled once the loop is seen back at the checkpoint
    channel.at_step_boundary(31, loop)
    assert recent(channel)[again]["status"] == "applied"


def test_a_rollback_goes_before_the_given_step_and_skips_through_the_later_of_incident_and_run_plus_margin(
    make_channel,
):
    channel = make_channel(rollback_margin_batches=7)
    loop = RecoveringLoop()
    action_id = post(channel, "rollback", before_step=25, lr_factor=0.5)
    channel.at_step_boundary(40, loop)
    (request,) = loop.requests
    assert (request.before_step, request.incident_step, request.skip_batches, request.lr_factor) == (25, 25, None, 0.5)
    assert request.window(20) == 25 - 20 + 7 and request.reason == "operator:unit"
    # The run trained 20 batches past the checkpoint (to step 40) before rolling back: all of them are skipped.
    assert request.window(20, trained_batches=20) == 20 + 7
    assert request.window(30) == 7  # a checkpoint after the incident: the margin alone
    channel.at_step_boundary(21, loop)
    assert recent(channel)[action_id]["status"] == "applied"


def test_a_rollback_tries_the_newest_checkpoint_before_its_step_and_in_a_young_run_the_oldest() -> None:
    def request(before: int, incident: int) -> RollbackRequest:
        return RollbackRequest(before, incident, None, 0, 1.0, "alert:RankscopeLossDiverging")

    assert request(1000, 1200).checkpoint_order([462, 924, 1386, 924]) == [924, 462]
    assert request(462, 700).checkpoint_order([462, 924]) == []  # the checkpoint at the step is not before it
    # An alert's lookback that reached past the run's first step (the channel says step 1): nothing is older, so
    # the checkpoints before the incident, oldest first; none before the incident is none at all.
    assert request(1, 1200).checkpoint_order([1386, 462, 924]) == [462, 924]
    assert request(1, 400).checkpoint_order([462, 924]) == []


def test_a_lookback_past_a_resumed_runs_first_step_asks_for_the_oldest_state_it_has(make_channel):
    channel = make_channel()
    loop = RecoveringLoop()
    for step in range(501, 531):  # resumed from a checkpoint at step 500
        channel.at_step_boundary(step, loop)
    at = {step: when for when, step in channel._history}
    request = ActionRequest("rollback", "alert", "alert:RankscopeLossDiverging", key="f@t", started_at=at[520] + 1e-6,
                            params={"incident_lookback_seconds": at[520] - at[501] + 60})  # fmt: skip
    channel.queue.submit([request])
    channel.at_step_boundary(531, loop)
    (sent,) = loop.requests
    # Not "before step 501", which would leave out the checkpoint the run resumed from: from the start, and the
    # moment the lookback reached, for a loop that knows when its checkpoints (also those before it) were written.
    assert (sent.before_step, sent.incident_step, sent.from_start) == (1, 520, True)
    assert sent.before_time == pytest.approx(at[501] - 60, abs=1e-3)
    assert sent.checkpoint_order([500, 510, 520]) == [500, 510]


def test_a_rollback_from_an_alert_goes_back_to_the_step_at_its_starts_at(make_channel):
    channel = make_channel()
    loop = RecoveringLoop()
    for step in range(1, 31):
        channel.at_step_boundary(step, loop)
    middle = channel._history[14][0]  # when the run was at step 15
    request = ActionRequest("rollback", "alert", "alert:RankscopeLossDiverging", key="f@t", started_at=middle + 1e-6)
    channel.queue.submit([request])
    channel.at_step_boundary(31, loop)
    assert loop.requests[-1].before_step == 15 and loop.requests[-1].incident_step == 15


def test_a_rollback_from_a_smoothed_alert_goes_back_to_before_its_signal_began_to_build(make_channel):
    """A smoothed signal crosses its line after the fault began (a loss median over 2m: a minute later): the
    alert's incident_lookback_seconds puts the incident that much before its startsAt, so the checkpoint rolled
    back to was written before the fault, not after it (with the fault's damage in it)."""
    channel = make_channel()
    loop = RecoveringLoop()
    for step in range(1, 31):
        channel.at_step_boundary(step, loop)
    at = {step: when for when, step in channel._history}
    request = ActionRequest("rollback", "alert", "alert:RankscopeLossDiverging", key="f@t", started_at=at[25] + 1e-6,
                            params={"incident_lookback_seconds": at[25] - at[12]})  # fmt: skip
    channel.queue.submit([request])
    channel.at_step_boundary(31, loop)
    # Back to before step 12; the data skipped still runs through the alert's incident (step 25), plus the margin.
    assert loop.requests[-1].before_step == 12 and loop.requests[-1].incident_step == 25


@pytest.mark.parametrize(
    ("alert", "action", "annotation", "parameter"),
    [
        (
            "RankscopeLossDiverging",
            "rollback",
            {"incident_lookback_seconds": "120"},
            {"incident_lookback_seconds": 120.0},
        ),
        ("RankscopeNonFiniteSteps", "reduce_lr", {"restore_after_steps": "2000"}, {"restore_after_steps": 2000}),
    ],
)
def test_an_action_parameter_comes_from_the_alerts_annotations(alert, action, annotation, parameter):
    from rankscope.control.alerts import parse_alert_payload

    body = {"version": "4", "status": "firing", "alerts": [{
        "status": "firing", "labels": {"alertname": alert, "action": action}, "annotations": annotation,
        "startsAt": "2026-12-04T09:00:00Z", "fingerprint": "f"}]}  # fmt: skip
    (request,) = parse_alert_payload(body).requests
    assert request.params == parameter


def test_a_rollback_to_the_checkpoint_just_before_it_still_says_the_run_went_back(make_channel):
    # Applied at step 31, back to the checkpoint of step 30: the loop trains step 31 again, seen at the same
    # boundary number, and the outcome said nothing of going back (test_cli's rollback failed so one run in ten).
    channel = make_channel()
    loop = RecoveringLoop()
    action_id = post(channel, "rollback")
    channel.at_step_boundary(31, loop)
    channel.at_step_boundary(31, loop)
    record = recent(channel)[action_id]
    assert (record["status"], record["step"], record["detail"]) == ("applied", 31, "the run went back to step 31")


def test_a_rollback_the_loop_did_not_follow_is_overridden(make_channel):
    channel = make_channel()
    action_id = post(channel, "rollback")
    loop = RecoveringLoop()
    channel.at_step_boundary(40, loop)
    channel.at_step_boundary(41, loop)  # the loop trained on from 40 instead of from 30
    record = recent(channel)[action_id]
    assert record["status"] == "overridden" and "went on from step 40" in record["detail"], record


def test_a_rollback_while_paused_is_applied_once_the_resumed_loop_trains_from_the_checkpoint(make_channel):
    channel = make_channel(pause_heartbeat_seconds=0.05)
    loop = RecoveringLoop()
    post(channel, "pause")
    rollback, resume = [], []

    def operator() -> None:
        wait_for(lambda: channel.paused, 10, "the pause")
        rollback.append(post(channel, "rollback"))
        wait_for(lambda: loop.requests, 10, "the rollback to be carried out")
        time.sleep(0.2)  # held over a span of heartbeats (0.05 s): the rollback must stay pending throughout
        resume.append(post(channel, "resume"))

    helper = threading.Thread(target=operator)
    helper.start()
    channel.at_step_boundary(40, loop)  # held here until resumed
    helper.join()
    assert rollback[0] not in recent(channel)
    channel.at_step_boundary(31, loop)
    assert recent(channel)[rollback[0]]["status"] == "applied"


def test_a_rollback_with_no_checkpoint_before_the_incident_is_refused_unavailable(make_channel, monitor):
    channel = make_channel()
    action_id = post(channel, "rollback", before_step=5)
    channel.at_step_boundary(40, RecoveringLoop())
    record = recent(channel)[action_id]
    assert record["status"] == "refused_unavailable" and "no checkpoint before step 5" in record["detail"]
    assert actions_total(monitor, "rollback", "operator", "refused_unavailable") == 1


def test_reduce_micro_batch_is_applied_until_it_cannot_be_halved(make_channel):
    channel = make_channel(micro_batch_cooldown_seconds=0.0, micro_batch_max_reductions=0)
    loop = RecoveringLoop(micro_batch=8)
    outcomes = []
    for step in (1, 2, 3):
        action_id = post(channel, "reduce_micro_batch")
        channel.at_step_boundary(step, loop)
        outcomes.append(recent(channel)[action_id]["status"])
    assert outcomes == ["applied", "applied", "refused_unavailable"]
    assert (loop.micro_batch, loop.accumulation) == (2, 4)


def test_a_micro_batch_change_that_alters_the_global_batch_is_failed(make_channel):
    class Careless(RecoveringLoop):
        def reduce_micro_batch(self, reason: str) -> MicroBatchChange:
            return MicroBatchChange(8, 1, 16, 1)  # halved without doubling accumulation

    channel = make_channel()
    action_id = post(channel, "reduce_micro_batch")
    channel.at_step_boundary(1, Careless())
    record = recent(channel)[action_id]
    assert record["status"] == "failed" and "not a smaller micro-batch of the same global batch" in record["detail"]


def test_resume_without_a_pause_is_a_noop(make_channel):
    channel = make_channel()
    action_id = post(channel, "resume")
    channel.at_step_boundary(1, LoopHandler())
    assert recent(channel)[action_id]["status"] == "noop"


def test_a_pause_holds_the_boundary_until_resume(make_channel, monitor):
    channel = make_channel(pause_heartbeat_seconds=0.05)
    handler = LoopHandler()
    post(channel, "pause")
    returned: list[list[str]] = []
    loop = threading.Thread(target=lambda: returned.append(channel.at_step_boundary(4, handler)))
    loop.start()
    deadline = time.monotonic() + 30
    while not channel.snapshot.read()["paused"]:
        assert time.monotonic() < deadline, "the channel never paused"
        time.sleep(0.01)
    paused_gauge = monitor.registry.get_sample_value("rankscope_paused", monitor.identity.labels())
    post(channel, "checkpoint")  # actions still apply while paused
    post(channel, "resume")
    loop.join(timeout=30)
    assert not loop.is_alive()
    assert returned == [["pause", "checkpoint", "resume"]]
    assert paused_gauge == 1
    assert monitor.registry.get_sample_value("rankscope_paused", monitor.identity.labels()) == 0
    assert channel.snapshot.read()["paused"] is False


def test_stop_ends_a_pause_and_asks_the_loop_to_stop(make_channel, monitor):
    channel = make_channel(pause_heartbeat_seconds=0.05)
    handler = LoopHandler()
    post(channel, "pause")
    stop = post(channel, "stop")
    assert channel.at_step_boundary(9, handler) == ["pause", "stop"]
    assert handler.stop_reason == "operator:unit"
    assert channel.stop_requested and not channel.paused
    status = requests.get(channel.url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert status.json()["stopping"] is True
    assert stop in {r["id"] for r in status.json()["pending"]}  # until the loop has left
    channel.close()
    assert recent(channel)[stop]["status"] == "applied"
    assert actions_total(monitor, "stop", "operator", "applied") == 1


def test_finish_shows_the_stop_applied_logs_it_and_serves_while_it_lingers(make_channel, monitor, caplog):
    """The end of a run: the stop is applied, one line says so, and /v1/status shows it before the endpoint
    closes (close() alone shut the endpoint in the same call, so no one could ever see "applied")."""
    channel = make_channel()
    stop = post(channel, "stop")
    channel.at_step_boundary(4, LoopHandler())
    seen: dict = {}

    def watch() -> None:  # what an operator (or rankscope-ctl) polling /v1/status sees during the linger
        while "status" not in seen:
            try:
                body = requests.get(
                    channel.url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
                ).json()
            except requests.ConnectionError:
                return
            done = {r["id"]: r["status"] for r in body.get("recent", [])}
            if stop in done:
                seen["status"] = done[stop]

    watcher = threading.Thread(target=watch)
    watcher.start()
    with caplog.at_level("INFO", logger="rankscope"):
        channel.finish(linger_seconds=1.0)
    watcher.join(timeout=10)
    assert seen.get("status") == "applied"
    assert "rank 0 applied stop at step 4" in caplog.text
    assert actions_total(monitor, "stop", "operator", "applied") == 1


def test_a_loop_that_trains_on_after_a_stop_gets_it_overridden(make_channel):
    channel = make_channel()
    stop = post(channel, "stop")
    channel.at_step_boundary(5, LoopHandler())
    channel.at_step_boundary(6, LoopHandler())  # a loop that did not break
    record = recent(channel)[stop]
    assert record["status"] == "overridden" and "went on training" in record["detail"]
    assert not channel.stop_requested


def test_a_stop_the_loop_refuses_is_failed_and_the_run_takes_requests_again(make_channel):
    class Refusing(LoopHandler):
        def request_stop(self, reason: str) -> None:
            raise RuntimeError("not before min_steps")

    channel = make_channel()
    stop = post(channel, "stop")
    channel.at_step_boundary(1, Refusing())
    record = recent(channel)[stop]
    assert record["status"] == "failed" and "not before min_steps" in record["detail"]
    assert not channel.stop_requested and not channel.queue.stopping
    post(channel, "checkpoint")  # accepted (202), not "the run is stopping" (409)


def test_sigterm_means_checkpoint_then_stop_at_the_next_boundary(make_channel, monitor):
    import os
    import signal

    channel = make_channel()
    handler = LoopHandler()
    os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled by the channel's handler
    assert channel.at_step_boundary(4, handler) == ["stop"]
    assert handler.stop_reason == "signal:SIGTERM" and channel.stop_requested
    channel.close()
    assert actions_total(monitor, "stop", "signal", "applied") == 1
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler found at start is back


def test_a_channel_without_an_endpoint_needs_no_token_and_still_stops_on_a_signal(monitor, monkeypatch):
    import os
    import signal

    monkeypatch.delenv("RANKSCOPE_CONTROL_TOKEN", raising=False)
    channel = ControlChannel(ControlConfig(endpoint=False), monitor)
    try:
        assert channel.url is None
        handler = LoopHandler()
        assert channel.at_step_boundary(1, handler) == []
        os.kill(os.getpid(), signal.SIGINT)
        assert channel.at_step_boundary(2, handler) == ["stop"]
        assert handler.stop_reason == "signal:SIGINT"
    finally:
        channel.close()


def test_a_null_monitor_is_enough(monkeypatch, optimizer):
    monkeypatch.setenv("RANKSCOPE_CONTROL_TOKEN", TOKEN)
    channel = ControlChannel(ControlConfig(port=0), NullMonitor(), optimizer=optimizer)
    try:
        action_id = post(channel, "reduce_lr")
        assert channel.at_step_boundary(1, LoopHandler()) == ["reduce_lr"]
        optimizer.step()
        channel.at_step_boundary(2, LoopHandler())
        assert recent(channel)[action_id]["status"] == "applied"
    finally:
        channel.close()


# --- a real 2-rank job ----------------------------------------------------------------------

PG_TIMEOUT = 3.0  # the job's main process group timeout after start-up; the control group gets the same


@pytest.fixture(scope="module")
def job(control_job):
    settings = {
        "group_timeout_seconds": PG_TIMEOUT,
        "lr_cooldown_seconds": 0.0,
        "lr_cooldown_steps": 1000,  # a second reduce_lr right away is refused
    }
    running = control_job(settings, pg_timeout=PG_TIMEOUT)
    running.wait_ready()
    return running


def both_ranks_at(job, step):
    records = [job.step_record(rank, step) for rank in (0, 1)]
    return records[0], records[1]


@pytest.mark.integration
def test_reduce_lr_changes_both_ranks_at_the_same_step_and_the_scheduler_keeps_it(job):
    applied_id, refused_id = job.post_action("reduce_lr"), job.post_action("reduce_lr")
    applied, refused = job.wait_settled(applied_id), job.wait_settled(refused_id)
    assert applied["status"] == "applied"
    assert refused["status"] == "refused_cooldown"
    step = applied["step"]
    job.wait_for(lambda: all(job.steps(r)[-1]["step"] > step + 10 for r in (0, 1)), "10 more steps on both ranks")
    rank0, rank1 = both_ranks_at(job, step)
    assert rank0["applied"] == rank1["applied"] == ["reduce_lr"]
    assert rank0["lr"] == rank1["lr"] == pytest.approx([0.05])
    for rank in (0, 1):
        before = [r["lr"][0] for r in job.steps(rank) if "exit" not in r and 5 <= r["step"] < step]
        after = [r["lr"][0] for r in job.steps(rank) if "exit" not in r and r["step"] >= step]
        assert set(before) == {0.1}, f"rank {rank}: {before}"
        assert after == pytest.approx([0.05] * len(after)), f"rank {rank}: the scheduler undid the reduction"


@pytest.mark.integration
def test_a_reduction_for_a_number_of_steps_is_given_back_on_both_ranks_at_the_same_step(control_job):
    running = control_job({"group_timeout_seconds": PG_TIMEOUT, "lr_cooldown_seconds": 0.0}, pg_timeout=PG_TIMEOUT)
    running.wait_ready()
    action_id = running.post_action("reduce_lr", restore_after_steps=20)
    applied = running.wait_settled(action_id)
    assert applied["status"] == "applied"
    step = applied["step"]
    running.wait_for(lambda: all(running.steps(r)[-1]["step"] > step + 30 for r in (0, 1)), "30 more steps on both")
    rates = []
    for rank in (0, 1):
        trained = {r["step"]: r["lr"][0] for r in running.steps(rank) if "exit" not in r and r["step"] >= step}
        rates.append([trained[s] for s in range(step, step + 31)])
    assert rates[0] == rates[1]
    # Halved at the step it was applied, given back at the first boundary 20 steps on, once it was judged.
    back = next(i for i, lr in enumerate(rates[0]) if lr == pytest.approx(0.1))
    assert 20 <= back <= 22, rates[0]
    assert rates[0][:back] == pytest.approx([0.05] * back) and rates[0][back:] == pytest.approx([0.1] * (31 - back))


@pytest.mark.integration
def test_checkpoint_writes_a_file_on_both_ranks_at_the_same_step_with_its_reason(job):
    record = job.wait_settled(job.post_action("checkpoint", reason="before upgrade"))
    assert record["status"] == "applied"
    for rank in (0, 1):
        written = (job.out / f"ckpt-rank{rank}-step{record['step']}.json").read_text()
        assert '"reason": "operator:before upgrade"' in written


@pytest.mark.integration
def test_a_pause_longer_than_the_process_group_timeout_holds_both_ranks_at_one_step(job):
    record = job.wait_settled(job.post_action("pause"))
    assert record["status"] == "applied"
    step = record["step"]
    pages = {r: samples(fetch(f"http://127.0.0.1:{job.ready(r)['metrics_port']}/metrics")) for r in (0, 1)}
    assert [sample_value(pages[r], "rankscope_paused") for r in (0, 1)] == [1, 1]
    paused_since = job.status()["paused_since"]
    # Held for 2.5 process-group timeouts, while the step stays where the pause caught it.
    job.wait_for(
        lambda: time.time() - paused_since > 2.5 * PG_TIMEOUT and job.status()["step"] == step,
        "a long pause",
        timeout=30,
    )
    assert job.status()["paused"] is True and job.status()["step"] == step
    assert job.wait_settled(job.post_action("resume"))["status"] == "applied"
    job.wait_for(lambda: all(job.steps(r)[-1]["step"] > step + 3 for r in (0, 1)), "training to go on")
    rank0, rank1 = both_ranks_at(job, step)
    assert rank0["applied"] == rank1["applied"] == ["pause", "resume"]
    assert rank0["held"] > 2.5 * PG_TIMEOUT and rank1["held"] > 2.5 * PG_TIMEOUT
    page = samples(fetch(f"http://127.0.0.1:{job.ready(1)['metrics_port']}/metrics"))
    assert sample_value(page, "rankscope_paused") == 0


@pytest.mark.integration
def test_stop_checkpoints_and_exits_zero_on_every_rank(job):
    action_id = job.post_action("stop", reason="done")
    assert job.wait_exit() == 0
    exits = [job.steps(rank)[-1] for rank in (0, 1)]
    assert exits[0] == exits[1] == {"exit": True, "step": exits[0]["step"], "stop_reason": "operator:done"}
    step = exits[0]["step"]
    for rank in (0, 1):
        assert '"reason": "stop:operator:done"' in (job.out / f"ckpt-rank{rank}-step{step}.json").read_text()
        assert job.step_record(rank, step)["applied"] == ["stop"]
    metrics = samples((job.out / "rank0.metrics.txt").read_text())
    for action, result, count in (
        ("reduce_lr", "applied", 1),
        ("reduce_lr", "refused_cooldown", 1),
        ("checkpoint", "applied", 1),
        ("pause", "applied", 1),
        ("resume", "applied", 1),
        ("stop", "applied", 1),
    ):
        got = sample_value(metrics, "rankscope_control_actions_total", action=action, source="operator", result=result)
        assert got == count, (action, result, got, action_id)
    assert sample_value(metrics, "rankscope_checkpoints_total", reason="operator") == 1
    assert sample_value(metrics, "rankscope_checkpoints_total", reason="stop") == 1


@pytest.mark.integration
def test_every_rank_names_the_action_in_its_log_lines(job):
    """Rank 1 never sees the action's record (rank 0 holds it): its lines name the action from the order."""
    job.wait_exit()
    log = job.log.read_text()
    for action in ("reduce_lr", "checkpoint", "pause", "resume", "stop"):
        assert re.search(rf"rank 1 applied {action} at step \d+", log), (action, log[-3000:])
    assert not re.search(r"rank \d+:? (applied )?\? ", log), log[-3000:]
