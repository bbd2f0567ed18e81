"""rankscope.serving.exposition: the fast renderer says what prometheus_client says, and the page cache holds."""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from rankscope import Monitor, MonitorConfig, RankIdentity
from rankscope.serving.exposition import CachedPage, PageRenderer

NASTY = 'back\\slash "quoted"\nnew line, ünïcødé'


def parsed(page: bytes) -> dict[str, tuple[str, str, list[tuple[str, tuple, str]]]]:
    """family name -> (type, help, [(sample, sorted labels, value as text)]), without `_created` series.
    Values as repr() so NaN equals NaN."""
    families = {}
    for family in text_string_to_metric_families(page.decode("utf-8")):
        found = [(s.name, tuple(sorted(s.labels.items())), repr(s.value)) for s in family.samples]
        found = [s for s in found if not s[0].endswith("_created")]
        if found or not family.name.endswith("_created"):
            families[family.name] = (family.type, family.documentation, sorted(found))
    return families


class CustomCollector:
    """A collector of the kind the probes are: families built at collect time."""

    def collect(self):
        gauge = GaugeMetricFamily("custom_gauge", "built per scrape \\ with\nnewline", labels=["who", "kind"])
        gauge.add_metric([NASTY, "a"], 1.5)
        gauge.add_metric(["plain", "b"], float("nan"), timestamp=1700000000.25)
        yield gauge
        histogram = GaugeHistogramMetricFamily("custom_gauge_histogram", "a gauge histogram", labels=["who"])
        histogram.add_metric(["x"], [("1.0", 2.0), ("+Inf", 3.0)], gsum_value=4.5)
        yield histogram

    def describe(self):
        return []


def every_kind() -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("jobs", "jobs done", ["who", "kind"], registry=registry)
    counter.labels(NASTY, "a").inc(3)
    counter.labels("plain", "b").inc(0.5)
    Counter("bare", "no labels\\at all", registry=registry).inc(7)
    gauge = Gauge("level_bytes", "a level", ["who"], registry=registry)
    gauge.labels(NASTY).set(-2.5)
    gauge.labels("inf").set(float("inf"))
    gauge.labels("minus inf").set(float("-inf"))
    gauge.labels("nan").set(float("nan"))
    gauge.labels("big").set(123456789.0)
    gauge.labels("tiny").set(1e-300)
    Gauge("computed", "set_function", registry=registry).set_function(lambda: 42.0)
    Gauge("unused", "a parent without children", ["who"], registry=registry)
    histogram = Histogram("wait_seconds", "waits", ["who"], buckets=(0.005, 0.25, 1.0, 2.5, 1e7), registry=registry)
    for value in (0.001, 0.1, 0.3, 2.0, 3.0, 1e8):
        histogram.labels(NASTY).observe(value)
    histogram.labels("empty")
    negative = Histogram("delta", "bounds below zero: no _sum", buckets=(-1.0, 0.0, 1.0), registry=registry)
    negative.observe(-3.0)
    negative.observe(0.5)
    Info("build", "build facts", ["who"], registry=registry).labels(NASTY).info({"version": NASTY, "git": "abc"})
    Info("plain_build", "no labels", registry=registry).info({"v": "1"})
    Summary("latency_seconds", "a summary", ["who"], registry=registry).labels("x").observe(0.7)
    Enum("state", "an enum", ["who"], states=["up", "down"], registry=registry).labels("x").state("down")
    registry.register(CustomCollector())
    return registry


def test_the_page_has_every_family_sample_and_value_of_generate_latest_minus_created():
    registry = every_kind()
    ours, theirs = parsed(PageRenderer(registry).render()), parsed(generate_latest(registry))
    assert ours == theirs
    assert {"jobs", "bare", "level_bytes", "wait_seconds", "delta", "build_info", "custom_gauge"} <= set(ours)
    assert ("wait_seconds_bucket", (("le", "+Inf"), ("who", "empty")), "0.0") in ours["wait_seconds"][2]


def test_no_created_series_and_each_family_once():
    page = PageRenderer(every_kind()).render().decode()
    assert "_created" not in page
    types = [line.split()[2] for line in page.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))


def test_the_target_info_and_a_registry_that_is_only_a_collector_are_rendered_too():
    registry = CollectorRegistry(target_info={"cluster": NASTY})
    Counter("c", "c", registry=registry).inc()
    assert parsed(PageRenderer(registry).render()) == parsed(generate_latest(registry))
    collector = CustomCollector()
    assert parsed(PageRenderer(collector).render()) == parsed(generate_latest(collector))


def test_children_added_removed_and_made_again_are_followed():
    registry = CollectorRegistry()
    counter = Counter("c", "c", ["k"], registry=registry)
    renderer = PageRenderer(registry)
    counter.labels("a").inc()
    renderer.render()
    counter.remove("a")
    counter.labels("b").inc(2)
    assert parsed(renderer.render()) == parsed(generate_latest(registry))
    counter.labels("a").inc(5)  # a new child under an old label set
    late = Gauge("late", "registered after the first render", registry=registry)
    late.set(1)
    assert parsed(renderer.render()) == parsed(generate_latest(registry))
    registry.unregister(late)
    assert "late" not in parsed(renderer.render())


def test_a_monitors_page_matches_generate_latest_after_training_steps():
    identity = RankIdentity(run_id="r1", rank=3, local_rank=1, world_size=4, node='node\\"0"')
    monitor = Monitor(MonitorConfig(base_port=0, probes=(), model_name="m"), identity, device="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.watch(model, optimizer)
    for _ in range(6):
        with monitor.step(samples=8, tokens=80) as step:
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            norm = monitor.clip_grad_norm_(model.parameters(), 1.0)
            step.record(loss=loss, grad_norm=norm)
            optimizer.step()
            optimizer.zero_grad()
    monitor.flush()
    ours, theirs = parsed(PageRenderer(monitor.registry).render()), parsed(generate_latest(monitor.registry))
    assert ours == theirs
    steps = dict(((n, dict(ls).get("le")), v) for n, ls, v in ours["rankscope_step_duration_seconds"][2])
    assert steps[("rankscope_step_duration_seconds_count", None)] == "6.0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_cache_renders_at_most_once_per_period():
    renders = []
    clock = FakeClock()
    page = CachedPage(lambda: renders.append(clock.now) or f"page {len(renders)}".encode(), 1.0, clock)
    assert page.get() == b"page 1"
    clock.now += 0.999
    assert page.get() == b"page 1"
    clock.now += 0.001
    assert page.get() == b"page 2"
    assert renders == [100.0, 101.0]


def test_a_zero_period_renders_every_time_and_a_failed_render_is_not_kept():
    calls = []

    def render() -> bytes:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("collector broke")
        return b"ok"

    page = CachedPage(render, 0.0, FakeClock())
    assert page.get() == b"ok"
    with pytest.raises(RuntimeError):
        page.get()
    assert page.get() == b"ok" and len(calls) == 3


def test_the_compressed_page_is_the_page_and_made_once_per_render():
    import gzip

    page = CachedPage(lambda: b"x" * 10_000, 60.0, FakeClock())
    first = page.get(compressed=True)
    assert gzip.decompress(first) == b"x" * 10_000 and len(first) < 200
    assert page.get(compressed=True) is first


@pytest.mark.parametrize("seconds", [-1.0, math.nan])
def test_a_bad_period_is_refused(seconds):
    with pytest.raises(ValueError, match="page cache seconds must be >= 0"):
        CachedPage(lambda: b"", seconds)


@pytest.mark.parametrize("value", [-0.5, float("nan"), "1", True, 1e9])
def test_monitor_config_names_a_bad_page_cache_setting(value):
    with pytest.raises(ValueError, match="metrics.page_cache_seconds must be between 0 and 3600"):
        MonitorConfig(page_cache_seconds=value)


def test_a_gauge_given_a_function_after_the_first_render_shows_the_function():
    # Issue 24: the renderer was fixed at the first render, so the page kept the old value.
    registry = CollectorRegistry()
    plain = Gauge("rankscope_test_plain", "no labels", registry=registry)
    labelled = Gauge("rankscope_test_labelled", "labels", ["kind"], registry=registry)
    plain.set(1)
    labelled.labels(kind="a").set(1)
    renderer = PageRenderer(registry)
    assert b"rankscope_test_plain 1.0" in renderer.render()
    plain.set_function(lambda: 42)
    labelled.labels(kind="a").set_function(lambda: 7)
    page = renderer.render()
    assert parsed(page) == parsed(generate_latest(registry))  # what prometheus_client shows
    assert b"rankscope_test_plain 42.0" in page and b'rankscope_test_labelled{kind="a"} 7.0' in page


def test_a_state_change_makes_the_next_request_render_within_the_cache_period():
    # Issue 23: the page was reused for its whole period, so a scrape right after finish() or an
    # action could show the state before it.
    from rankscope.serving.exposition import state_changed

    now, renders = [0.0], []

    def render() -> bytes:
        renders.append(now[0])
        return b"page %d" % len(renders)

    page = CachedPage(render, 60.0, clock=lambda: now[0])
    assert page.get() == b"page 1" and page.get() == b"page 1"
    state_changed()
    assert page.peek() is None  # the I/O thread never serves the stale page
    assert page.get() == b"page 2" and page.get() == b"page 2"
    now[0] = 1.0
    assert page.peek() == b"page 2"


def test_a_publication_that_never_ends_does_not_hold_the_page_back():
    """A publisher stopped inside a publication (a signal handler running on the training thread) must not
    stop the page: after the renderer's patience it reads the values as they stand."""
    import threading

    from rankscope.serving.exposition import Publication
    from support import wait_for

    registry = CollectorRegistry()
    Gauge("level", "a gauge", registry=registry).set(1.5)
    publication = Publication()
    publication.__enter__()  # entered, never left
    pages: list[bytes] = []
    render = threading.Thread(target=lambda: pages.append(PageRenderer(registry, publication).render()), daemon=True)
    render.start()
    wait_for(lambda: pages, 30, "the page rendered while a publication is stuck")
    assert "level 1.5" in pages[0].decode()
