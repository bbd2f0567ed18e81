"""Monitor: every metric the public API records, asserted on the monitor's own registry."""

import math

import pytest
import torch
from rankscope import Monitor, MonitorConfig, NullMonitor, RankIdentity, create_monitor

IDENTITY = RankIdentity(run_id="t1", rank=0, local_rank=0, world_size=1, node="n0")
LABELS = IDENTITY.labels()


def value(monitor, name, **extra):
    return monitor.registry.get_sample_value(name, {**LABELS, **extra})


def make(**config):
    """A monitor with the reference trainer's own metrics declared too (the tests record some of them)."""
    from rankscope_trainer.metrics import TRAINER_METRICS

    config.setdefault("base_port", 0)
    config.setdefault("probes", ("host",))
    return Monitor(MonitorConfig(**config), IDENTITY, device="cpu", extra_metrics=TRAINER_METRICS)


def tiny_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("encoder", torch.nn.Linear(4, 8))
    model.add_module("head", torch.nn.Linear(8, 1))
    return model


def train(monitor, steps, loss_fn=None, lr=0.05):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    monitor.watch(model, optimizer)
    batches = [torch.randn(8, 4) for _ in range(steps)]
    applied = 0
    for i, batch in enumerate(monitor.data(batches)):
        with monitor.step(samples=8, tokens=20) as step:
            loss = model(batch).pow(2).mean()
            if loss_fn is not None:
                loss = loss_fn(i, loss)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step.record(loss=loss, grad_norm=norm):
                optimizer.step()
                applied += 1
            optimizer.zero_grad()
    return model, applied


def test_steps_samples_tokens_and_timings_are_counted():
    monitor = make()
    train(monitor, 12)
    assert value(monitor, "rankscope_steps_total") == 12
    assert value(monitor, "rankscope_samples_total") == 96
    assert value(monitor, "rankscope_tokens_total") == 240
    assert value(monitor, "rankscope_step_duration_seconds_count") == 12
    assert value(monitor, "rankscope_data_wait_seconds_count") == 12
    assert value(monitor, "rankscope_compute_duration_seconds_count") == 12
    assert value(monitor, "rankscope_global_step") == 12
    assert value(monitor, "rankscope_last_step_timestamp_seconds") > 1.6e9
    step_sum = value(monitor, "rankscope_step_duration_seconds_sum")
    assert 0 < value(monitor, "rankscope_compute_duration_seconds_sum") <= step_sum


def test_loss_grad_norm_and_learning_rate_hold_the_latest_values():
    monitor = make()
    train(monitor, 3, lr=0.05)
    assert value(monitor, "rankscope_loss", split="train") > 0
    assert value(monitor, "rankscope_grad_norm") > 0
    assert value(monitor, "rankscope_learning_rate", param_group="0") == pytest.approx(0.05)
    monitor.record_loss(torch.tensor(0.25))
    assert value(monitor, "rankscope_loss", split="val") == 0.25


def test_module_grad_norms_and_update_ratios_follow_the_interval():
    monitor = make(module_stats_every_n_steps=5)
    train(monitor, 4)
    assert value(monitor, "rankscope_module_grad_norm", module="encoder") is None
    train(monitor, 2)  # global steps 5..6: step 5 is due
    for module in ("encoder", "head"):
        assert value(monitor, "rankscope_module_grad_norm", module=module) > 0
        assert 0 < value(monitor, "rankscope_update_ratio", module=module) < 1


def test_without_the_guard_nonfinite_steps_are_counted_and_one_nan_poisons_every_later_step():
    monitor = make()
    model, applied = train(monitor, 6, loss_fn=lambda i, loss: loss * float("nan") if i == 2 else loss)
    assert applied == 6
    assert value(monitor, "rankscope_nonfinite_steps_total") == 4  # steps 3..6
    assert value(monitor, "rankscope_skipped_steps_total") == 0
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_guard_skips_the_update_when_asked_and_the_model_stays_finite():
    monitor = make(skip_nonfinite=True)
    model, applied = train(monitor, 6, loss_fn=lambda i, loss: loss * float("inf") if i in (1, 4) else loss)
    assert applied == 4
    assert value(monitor, "rankscope_nonfinite_steps_total") == 2
    assert value(monitor, "rankscope_skipped_steps_total") == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_loss_spikes_are_counted():
    monitor = make(spike_window=5, spike_ratio=3.0)
    train(monitor, 12, loss_fn=lambda i, loss: loss * 1000 if i == 9 else loss)
    assert value(monitor, "rankscope_loss_spikes_total") == 1


def test_a_loops_own_metrics_are_recorded_through_set_inc_and_observe():
    monitor = make()
    monitor.set("text_padding_ratio", torch.tensor(0.25))
    monitor.inc("data_skipped_samples_total", 2, reason="missing_file")
    monitor.observe("text_length_tokens", torch.tensor([3, 5, 40]))
    monitor.set("rankscope_contrastive_accuracy_ratio", 0.5, split="train", direction="image_to_text")
    assert value(monitor, "rankscope_text_padding_ratio") == 0.25
    assert value(monitor, "rankscope_data_skipped_samples_total", reason="missing_file") == 2
    assert value(monitor, "rankscope_text_length_tokens_count") == 3
    assert value(monitor, "rankscope_text_length_tokens_sum") == 48
    assert value(monitor, "rankscope_contrastive_accuracy_ratio", split="train", direction="image_to_text") == 0.5


def test_unknown_metric_or_wrong_labels_are_named():
    monitor = make()
    with pytest.raises(KeyError, match="rankscope_nope"):
        monitor.set("nope", 1.0)
    with pytest.raises(ValueError, match=r"takes labels \['split'\]"):
        monitor.set("loss", 1.0)


def test_run_info_carries_the_run_facts():
    monitor = Monitor(MonitorConfig(base_port=0, model_name="clip-tiny", config_hash="abc"), IDENTITY, device="cpu")
    labels = {
        **LABELS,
        "world_size": "1",
        "node_rank": "0",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "none",
        "backend": "none",
        "model": "clip-tiny",
        "config_hash": "abc",
    }
    assert monitor.registry.get_sample_value("rankscope_run_info", labels) == 1


def test_a_step_that_raises_is_not_counted_and_the_error_propagates():
    monitor = make()
    with pytest.raises(RuntimeError, match="boom"), monitor.step(samples=4):
        raise RuntimeError("boom")
    assert value(monitor, "rankscope_steps_total") == 0


def test_set_step_continues_counting_after_a_resume():
    monitor = make()
    monitor.set_step(100)
    with monitor.step() as step:
        assert step.index == 101
    assert value(monitor, "rankscope_global_step") == 101


def test_counters_exist_at_zero_before_anything_happens():
    monitor = make()
    for name in ("rankscope_nonfinite_steps_total", "rankscope_loss_spikes_total", "rankscope_steps_total"):
        assert value(monitor, name) == 0
    assert value(monitor, "rankscope_monitor_errors_total", probe="host") == 0


def test_disabled_monitoring_is_a_null_sink_with_the_same_calls():
    monitor = create_monitor(MonitorConfig(enabled=False))
    assert isinstance(monitor, NullMonitor)
    for _batch in monitor.data([1, 2]):
        with monitor.step(samples=1) as step:
            assert step.record(loss=math.nan, grad_norm=1.0)
    assert monitor.global_step == 2


def test_run_finished_is_0_while_training_and_1_after_finish():
    monitor = make()
    assert value(monitor, "rankscope_run_finished") == 0
    train(monitor, 3)
    assert value(monitor, "rankscope_run_finished") == 0
    monitor.finish()
    assert value(monitor, "rankscope_run_finished") == 1
    assert value(monitor, "rankscope_steps_total") == 3
    NullMonitor().finish()  # the same call when monitoring is off


def test_set_each_sets_one_child_per_key_from_a_tensor_or_a_list():
    monitor = make()
    monitor.set_each("image_channel_mean", torch.tensor([0.5, -0.25, 1.0]), "channel", ("r", "g", "b"))
    assert [value(monitor, "rankscope_image_channel_mean", channel=c) for c in "rgb"] == [0.5, -0.25, 1.0]
    monitor.set_each("contrastive_accuracy_ratio", [0.75, 0.5], "direction", ("image_to_text", "text_to_image"),
                     split="val")  # fmt: skip
    assert value(monitor, "rankscope_contrastive_accuracy_ratio", split="val", direction="text_to_image") == 0.5
    with pytest.raises(ValueError, match="2 values for 3 channel keys"):
        monitor.set_each("image_channel_mean", [1.0, 2.0], "channel", ("r", "g", "b"))
    with pytest.raises(ValueError, match=r"one value per key, got a tensor of shape \(\)"):
        monitor.set_each("image_channel_mean", torch.tensor(1.0), "channel", ("r",))


def test_monitor_and_null_monitor_offer_the_same_public_methods():
    public = {name for name in dir(Monitor) if not name.startswith("_") and callable(getattr(Monitor, name))}
    missing = {name for name in public if not hasattr(NullMonitor, name)}
    assert not missing, f"NullMonitor lacks {sorted(missing)}"


def _twin_models_with_gradients():
    a, b = tiny_model(), tiny_model()
    batch = torch.randn(8, 4)
    for model in (a, b):
        (model(batch).pow(2).mean() * 50).backward()  # large gradients: clipping is active
    return a, b


@pytest.mark.parametrize("due", [True, False])
def test_clip_grad_norm_matches_torch_and_shares_its_norms_on_due_steps(due):
    monitor = make(module_stats_every_n_steps=1 if due else 1000)
    mine, reference = _twin_models_with_gradients()
    monitor.watch(mine, torch.optim.SGD(mine.parameters(), lr=0.1))
    expected_groups = {name: torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in child.parameters()]))
                       for name, child in mine.named_children()}  # fmt: skip
    with monitor.step() as step:
        total = monitor.clip_grad_norm_(mine.parameters(), 0.5)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        step.record(grad_norm=total)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6) and total.item() > 0.5
    for p, q in zip(mine.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    for name, norm in expected_groups.items():
        found = value(monitor, "rankscope_module_grad_norm", module=name)
        # Due: measured once, before clipping. Not due: not measured at all.
        assert found == pytest.approx(norm.item(), rel=1e-5) if due else found is None


def test_clip_grad_norm_of_other_parameters_is_torch_s_and_module_norms_still_come():
    monitor = make(module_stats_every_n_steps=1)
    mine, reference = _twin_models_with_gradients()
    monitor.watch(mine)
    with monitor.step() as step:
        total = monitor.clip_grad_norm_(mine.encoder.parameters(), 0.5)  # a subset: no sharing
        expected = torch.nn.utils.clip_grad_norm_(reference.encoder.parameters(), 0.5)
        step.record(grad_norm=total)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(mine.encoder.weight.grad, reference.encoder.weight.grad)
    assert torch.equal(mine.head.weight.grad, reference.head.weight.grad)  # untouched by either
    assert value(monitor, "rankscope_module_grad_norm", module="head") > 0  # recorded at step.record()
    with pytest.raises(RuntimeError, match="non-finite"):
        mine.head.weight.grad[0, 0] = float("nan")
        monitor.clip_grad_norm_(mine.parameters(), 0.5, error_if_nonfinite=True)  # torch's own check


def test_null_monitor_clips_with_torch():
    _, model = _twin_models_with_gradients()
    total = NullMonitor().clip_grad_norm_(model.parameters(), 0.5)
    assert total.item() > 0.5
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])) <= 0.5 + 1e-5


def _bulk_and_one_by_one_pages(make_child, values: list[float]) -> list[str]:
    """The page of `make_child(registry)` after observe_all(values), and after observing each value."""
    from prometheus_client import CollectorRegistry, generate_latest
    from rankscope.instruments import observe_all

    pages = []
    for bulk in (True, False):
        registry = CollectorRegistry()
        child = make_child(registry)
        if bulk:
            observe_all(child, values)
        else:
            for v in values:
                child.observe(v)
        page = generate_latest(registry).decode()
        pages.append("\n".join(line for line in page.splitlines() if "_created" not in line))
    return pages


def test_observing_a_tensor_gives_the_same_histogram_as_observing_each_value():
    from prometheus_client import Histogram

    values = [0.0, 1.0, 1.0, 2.5, 7.0, 7.0, 7.0, 100.0, 1e9, float("inf"), -3.0]
    pages = _bulk_and_one_by_one_pages(
        lambda registry: Histogram("h", "help", registry=registry, buckets=(1.0, 2.5, 7.0, 50.0)), values
    )
    assert pages[0] == pages[1]
    assert 'h_bucket{le="7.0"} 8.0' in pages[0]  # cumulative: -3, 0, 1, 1, 2.5 and three 7s


def test_observing_a_tensor_gives_the_same_summary_as_observing_each_value():
    from prometheus_client import Summary

    pages = _bulk_and_one_by_one_pages(
        lambda registry: Summary("s", "help", registry=registry), [0.0, 1.0, 2.5, 7.0, 1e9, -3.0]
    )
    assert pages[0] == pages[1]
    assert "s_count 6.0" in pages[0]


def test_a_nan_among_observed_values_takes_the_plain_path():
    from prometheus_client import CollectorRegistry, Histogram
    from rankscope.instruments import observe_all

    child = Histogram("h", "help", registry=CollectorRegistry(), buckets=(1.0,))
    observe_all(child, [0.5, float("nan"), 2.0])
    assert [b.get() for b in child._buckets] == [1.0, 1.0]  # NaN lands in no bucket, as observe() does


def _histogram(monitor, name):
    return value(monitor, name + "_count"), value(monitor, name + "_sum")


def test_a_batch_prefetched_inside_the_step_is_data_wait_but_not_added_to_the_step_time():
    monitor = make()
    with monitor.step():
        monitor.record_data_wait(0.25)  # e.g. the next batch fetched inside the step
    (steps, step_sum), (waits, wait_sum) = (
        _histogram(monitor, "rankscope_step_duration_seconds"),
        _histogram(monitor, "rankscope_data_wait_seconds"),
    )
    assert steps == 1 and waits == 1 and wait_sum == 0.25
    assert step_sum < 0.25  # the block took no time of its own: the wait is not counted twice
    assert value(monitor, "rankscope_compute_duration_seconds_sum") == 0.0


def test_a_wait_reported_before_the_step_is_added_and_several_waits_of_one_step_sum():
    monitor = make()
    monitor.record_data_wait(0.5)
    with monitor.step():
        monitor.record_data_wait(0.125)  # a second micro-batch fetched inside the step
    (_, step_sum), (waits, wait_sum) = (
        _histogram(monitor, "rankscope_step_duration_seconds"),
        _histogram(monitor, "rankscope_data_wait_seconds"),
    )
    assert waits == 1 and wait_sum == 0.625
    assert 0.5 <= step_sum < 0.625  # the wait before the block is added, the one inside is not


def test_a_loop_that_reports_no_data_wait_gets_no_data_wait_series():
    monitor = make()
    with monitor.step():
        pass
    assert value(monitor, "rankscope_data_wait_seconds_count") == 0.0


def _scaled_steps(monitor, losses_and_norms):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.watch(model, optimizer, scaler=scaler)
    applied = []
    for loss, norm in losses_and_norms:
        with monitor.step() as step:
            applied.append(step.record(loss=torch.tensor(loss), grad_norm=torch.tensor(norm)))
    return applied


def test_with_a_grad_scaler_overflows_are_counted_apart_from_non_finite_losses():
    monitor = make(skip_nonfinite=True)
    inf, nan = float("inf"), float("nan")
    applied = _scaled_steps(monitor, [(1.0, 0.5), (1.0, inf), (1.0, nan), (nan, nan), (1.0, 0.5)])
    assert value(monitor, "rankscope_loss_scale_overflows_total") == 2.0
    assert value(monitor, "rankscope_nonfinite_steps_total") == 1.0  # the NaN loss only
    # The guard leaves overflows to the scaler (it skips them itself) and skips the non-finite loss.
    assert applied == [True, True, True, False, True]
    assert value(monitor, "rankscope_loss_scale") == 1024.0


def test_without_a_grad_scaler_an_infinite_gradient_norm_is_a_non_finite_step():
    monitor = make()
    model = tiny_model()
    monitor.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with monitor.step() as step:
        step.record(loss=torch.tensor(1.0), grad_norm=torch.tensor(float("inf")))
    assert value(monitor, "rankscope_nonfinite_steps_total") == 1.0
    # Without a scaler there is no loss scale to speak of: neither series is exposed.
    assert value(monitor, "rankscope_loss_scale_overflows_total") is None
    assert value(monitor, "rankscope_loss_scale") is None


# --- what a step's batch costs: its longest sequence and its peak device memory ------------------------


def test_the_longest_sequence_of_each_step_is_recorded_as_the_loop_reports_it():
    monitor = make()
    with monitor.step(tokens=40, max_seq_len=17):
        pass
    assert value(monitor, "rankscope_sequence_length_max_tokens") == 17
    with monitor.step(tokens=30, max_seq_len=torch.tensor([3, 9, 5]).max()):  # a tensor is fine too
        pass
    assert value(monitor, "rankscope_sequence_length_max_tokens") == 9
    with monitor.step(tokens=30):  # a step that does not say keeps the last value a step reported
        pass
    assert value(monitor, "rankscope_sequence_length_max_tokens") == 9
    assert value(monitor, "rankscope_tokens_total") == 100


def test_a_loop_that_reports_no_sequence_length_gets_no_series():
    monitor = make()
    train(monitor, 3)
    assert value(monitor, "rankscope_sequence_length_max_tokens") is None


class FakeCudaAllocator:
    """The two host-side counters of torch.cuda's caching allocator that the monitor uses."""

    def __init__(self, allocated: int) -> None:
        self.allocated = self.peak = allocated
        self.resets: list[torch.device] = []

    def allocate(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.resets.append(device)
        self.peak = self.allocated

    def max_memory_allocated(self, device: torch.device) -> int:
        return self.peak


def cuda_monitor(monkeypatch, allocator: FakeCudaAllocator, **config) -> Monitor:
    """A monitor for a CUDA device whose allocator counters are `allocator` (this machine has no GPU)."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", allocator.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", allocator.max_memory_allocated)
    return Monitor(MonitorConfig(base_port=0, probes=(), **config), IDENTITY, device="cuda:0")


def test_on_cuda_each_step_records_its_own_peak_device_memory(monkeypatch):
    allocator = FakeCudaAllocator(allocated=1000)
    allocator.allocate(5000)  # before the first step (model load, say): not a step's peak
    allocator.allocate(-5000)
    monitor = cuda_monitor(monkeypatch, allocator, step_peak_memory=True)
    with monitor.step(max_seq_len=64):
        allocator.allocate(300)  # activations of a long batch
        allocator.allocate(-300)
    assert value(monitor, "rankscope_step_peak_device_memory_bytes") == 1300
    with monitor.step(max_seq_len=16):
        allocator.allocate(100)
        allocator.allocate(-100)
    # The peak was reset as the step began: this step's peak, not the run's.
    assert value(monitor, "rankscope_step_peak_device_memory_bytes") == 1100
    assert allocator.resets == [torch.device("cuda", 0)] * 2


def test_step_peak_memory_is_off_by_default_and_leaves_the_allocators_peak_alone(monkeypatch):
    allocator = FakeCudaAllocator(allocated=1000)
    monitor = cuda_monitor(monkeypatch, allocator)
    with monitor.step():
        allocator.allocate(300)
    assert allocator.resets == []
    assert value(monitor, "rankscope_step_peak_device_memory_bytes") is None


def test_on_cpu_there_is_no_device_memory_and_no_peak_series(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU monitor must not touch torch.cuda")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", no_cuda)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", no_cuda)
    monitor = make(step_peak_memory=True)
    train(monitor, 3)
    assert value(monitor, "rankscope_step_peak_device_memory_bytes") is None
    assert value(monitor, "rankscope_monitor_errors_total", probe="step_memory") is None


def test_a_failing_allocator_read_is_counted_once_and_training_goes_on(monkeypatch):
    allocator = FakeCudaAllocator(allocated=1000)
    monitor = cuda_monitor(monkeypatch, allocator, step_peak_memory=True)

    def broken(device):
        raise RuntimeError("allocator stats unavailable")

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", broken)
    for _ in range(3):
        with monitor.step():
            pass
    assert value(monitor, "rankscope_steps_total") == 3
    assert value(monitor, "rankscope_monitor_errors_total", probe="step_memory") == 1
    assert value(monitor, "rankscope_step_peak_device_memory_bytes") is None
    assert allocator.resets == [torch.device("cuda", 0)]  # switched off after the failure


def test_a_disabled_grad_scaler_is_said_once(caplog):
    """fp16 asked for where GradScaler cannot scale (it disables itself, e.g. on CPU without amp): say so once
    instead of ignoring it silently; the run trains unscaled, as torch's own scaler does."""
    from rankscope import Monitor, MonitorConfig, RankIdentity

    monitor = Monitor(MonitorConfig(probes=()), RankIdentity.from_env({}, run_id="scaler"), device="cpu")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with caplog.at_level("WARNING", logger="rankscope"):
        monitor.watch(model, optimizer, scaler=scaler)
        monitor.watch(model, optimizer, scaler=scaler)
    assert caplog.text.count("GradScaler is disabled") == 1, caplog.text
    monitor.close()


def _page_values(monitor) -> dict[str, float]:
    """global_step, loss and grad_norm as the /metrics page renders them now."""
    from prometheus_client.parser import text_string_to_metric_families
    from rankscope.serving.exposition import PageRenderer

    page = PageRenderer(monitor.registry).render().decode()
    wanted = {"rankscope_global_step": {}, "rankscope_loss": {"split": "train"}, "rankscope_grad_norm": {}}
    found = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            extra = wanted.get(sample.name)
            if extra is not None and all(sample.labels.get(k) == v for k, v in extra.items()):
                found[sample.name.removeprefix("rankscope_")] = sample.value
    return found


@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_a_page_rendered_between_record_and_the_step_s_end_shows_one_step_s_state(kind):
    monitor = make()
    values = {1: (2.0, 0.5), 2: (3.0, 0.25)}
    pages = []
    for step in (1, 2):
        loss, norm = values[step]
        if kind == "tensor":
            loss, norm = torch.tensor(loss), torch.tensor(norm)
        with monitor.step() as context:
            context.record(loss=loss, grad_norm=norm)
            pages.append(_page_values(monitor))  # a scrape landing inside the step, after record()
        pages.append(_page_values(monitor))  # and one after its end
    assert pages[1] == {"global_step": 1, "loss": 2.0, "grad_norm": 0.5}
    assert pages[2] == {"global_step": 1, "loss": 2.0, "grad_norm": 0.5}, "step 2's values beside step 1"
    assert pages[3] == {"global_step": 2, "loss": 3.0, "grad_norm": 0.25}


def test_a_scrape_in_progress_never_holds_up_the_step_s_end_and_its_page_is_still_one_step_s_state():
    """The page reads the registry while the training thread publishes a step's end: the publication must not
    wait for the page (a render takes up to milliseconds, a scrape's probes longer), and the page must not mix
    two steps either. A gauge of the loop's own, read from a function, holds one real scrape mid-read."""
    import threading

    from rankscope.contract import MetricKind, MetricSpec
    from support import fetch, samples, wait_for

    reading, release = threading.Event(), threading.Event()

    def held() -> float:
        reading.set()
        release.wait(timeout=60)
        return 1.0

    spec = MetricSpec("team_held_ratio", MetricKind.GAUGE, "A value read from a function at scrape time.", unit="ratio")
    monitor = Monitor(
        MonitorConfig(base_port=0, host="127.0.0.1", probes=(), page_cache_seconds=0),
        IDENTITY,
        device="cpu",
        extra_metrics=[spec],
    )
    monitor.instruments.child("team_held_ratio").set_function(held)
    server = monitor.start()
    pages: list[str] = []
    scrape = threading.Thread(target=lambda: pages.append(fetch(server.url, timeout=60)))
    ended = threading.Event()

    def one_step() -> None:
        with monitor.step() as step:
            step.record(loss=2.0, grad_norm=0.5)
        ended.set()

    try:
        scrape.start()
        wait_for(reading.is_set, 30, "the scrape reading the held gauge")
        training = threading.Thread(target=one_step)
        training.start()
        wait_for(ended.is_set, 10, "the step's end while a scrape is reading the page")
    finally:
        release.set()
        scrape.join(timeout=60)
    found = samples(pages[0])
    labels = tuple(sorted(LABELS.items()))
    step = found[("rankscope_global_step", labels)]
    loss = found.get(("rankscope_loss", tuple(sorted({**LABELS, "split": "train"}.items()))))
    assert (step, loss) == (1.0, 2.0), f"the page mixed two steps: global_step {step}, loss {loss}"
    monitor.close()


def test_a_host_value_held_until_the_step_s_end_is_the_value_it_had_when_recorded():
    monitor = make()
    with monitor.step() as context:
        loss = torch.tensor(2.0)
        context.record(loss=loss)
        loss.add_(1.0)  # the loop reuses the tensor before the step ends
    assert value(monitor, "rankscope_loss", split="train") == 2.0
