"""The prometheus_client internals rankscope reads are there, so the fast paths are the ones taken.

`rankscope.serving.exposition` renders Counter, Gauge and Histogram children from their `_value`,
`_buckets`, `_sum` and `_upper_bounds`, and `rankscope.instruments.observe_all` adds to a histogram's
buckets (a summary's `_count` and `_sum`) directly; on a client without them both fall back to slower
general paths, silently. These tests fail instead, so a prometheus_client release that moves them is
caught before the version range in pyproject.toml is widened (the range's bounds were run: 0.20.0 and 0.26.0).
"""

from __future__ import annotations

import re

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rankscope.instruments import observe_all
from rankscope.serving import exposition
from rankscope.serving.exposition import PageRenderer

from tests.support import REPO


def _registry() -> tuple[CollectorRegistry, dict[str, type]]:
    """One of each fast-path kind, labelled and not; -> (registry, metric name -> renderer kind expected)."""
    registry = CollectorRegistry()
    Counter("done", "labelled counter", ["who"], registry=registry).labels("a").inc(3)
    Counter("bare", "counter without labels", registry=registry).inc(0.5)
    Gauge("level", "labelled gauge", ["who"], registry=registry).labels("a").set(-2.5)
    Gauge("plain", "gauge without labels", registry=registry).set(7)
    wait = Histogram("wait_seconds", "labelled histogram", ["who"], buckets=(0.1, 1.0), registry=registry)
    wait.labels("a").observe(0.3)
    Histogram("size_bytes", "histogram without labels", buckets=(10.0, 100.0), registry=registry).observe(50)
    scalar, buckets = exposition._Scalar, exposition._Buckets
    expected = {"done": scalar, "bare": scalar, "level": scalar, "plain": scalar}
    expected.update({"wait_seconds": buckets, "size_bytes": buckets})
    return registry, expected


def _samples(page: bytes) -> dict[str, tuple[str, str, list[tuple[str, tuple, float]]]]:
    """family -> (type, help, samples) of a page, minus the `_created` series (which the renderer drops);
    label order aside (clients before 0.21 put `le` first)."""
    found = {}
    for family in text_string_to_metric_families(page.decode()):
        kept = sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in family.samples)
        kept = [s for s in kept if not s[0].endswith("_created")]
        if kept:
            found[family.name] = (family.type, family.documentation, kept)
    return found


def test_counter_gauge_and_histogram_take_the_fast_path_and_say_what_generate_latest_says():
    registry, expected = _registry()
    renderer = PageRenderer(registry)
    page = renderer.render()
    assert renderer._walk, "the registry's internals (_lock, _collector_to_names, _target_info) are gone"
    kinds = {family.metric._name: {type(r) for r in family.renderers} for family in renderer._families.values()}
    assert kinds == {name: {kind} for name, kind in expected.items()}, prometheus_client.__file__
    assert _samples(page) == _samples(generate_latest(registry))
    # The renderer reads the live values: a change shows on the next render, through the same fast path.
    registry._names_to_collectors["done_total"].labels("a").inc()
    assert 'done_total{who="a"} 4.0' in renderer.render().decode()


def test_observe_all_adds_to_the_histogram_internals_as_observe_does():
    fast, slow = CollectorRegistry(), CollectorRegistry()
    values = [0.05, 0.1, 0.5, 2.0, 30.0]
    fast_child = Histogram("h", "h", buckets=(0.1, 1.0), registry=fast)
    for attr in ("_upper_bounds", "_buckets", "_sum"):
        assert hasattr(fast_child, attr), f"prometheus_client {attr} is gone: observe_all takes the slow loop"
    observe_all(fast_child, values)
    slow_child = Histogram("h", "h", buckets=(0.1, 1.0), registry=slow)
    for value in values:
        slow_child.observe(value)
    assert _samples(generate_latest(fast)) == _samples(generate_latest(slow))


def test_observe_all_adds_to_the_summary_internals_as_observe_does():
    fast, slow = CollectorRegistry(), CollectorRegistry()
    values = [0.05, 0.5, 30.0]
    fast_child = Summary("s", "s", registry=fast)
    for attr in ("_count", "_sum"):
        assert hasattr(fast_child, attr), f"prometheus_client {attr} is gone: observe_all takes the slow loop"
    observe_all(fast_child, values)
    slow_child = Summary("s", "s", registry=slow)
    for value in values:
        slow_child.observe(value)
    assert _samples(generate_latest(fast)) == _samples(generate_latest(slow))


def test_the_installed_client_is_inside_the_declared_range():
    """The range pyproject.toml declares holds the client these tests just ran on."""
    from importlib.metadata import version as installed_version

    import tomllib

    installed = installed_version("prometheus-client")

    (spec,) = [
        dep
        for dep in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
        if dep.startswith("prometheus-client")
    ]
    low, high = re.fullmatch(r"prometheus-client>=([\d.]+),<([\d.]+)", spec).groups()

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:3])

    assert version(low) <= version(installed) < version(high), (spec, installed)
