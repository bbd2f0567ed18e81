"""One rank's /metrics page: the Prometheus text format (0.0.4), rendered fast and cached briefly.

    render = PageRenderer(registry).render      # bytes, like prometheus_client.generate_latest(registry)
    page = CachedPage(render, seconds=1.0)      # at most one render (and one run of the probes) per second
    body = page.get()

`PageRenderer` gives the same families, samples and values as `generate_latest`, minus the
`_created` series (a creation timestamp per counter and histogram child: they double the series
count and no rule or panel reads them). It is several times faster because the text that never
changes is rendered once per child: `name{run_id="..",rank="..",...,le="0.5"} ` for every sample
of a prometheus_client Counter, Gauge or Histogram child; per scrape only the numbers are read
and formatted. Other collectors (the scrape-time probes, a user's own) go through their
`collect()`, formatted as `generate_latest` formats them. It relies on prometheus_client's
metric internals (`_metrics`, `_value`, `_buckets`, `_sum`, `_upper_bounds`), as
`rankscope.instruments.observe_all` does; where one is missing, that metric takes the general path.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.utils import floatToGoString

try:  # prometheus_client >= 0.21 knows UTF-8 names and escapes the rest to underscores
    from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
except ImportError:  # pragma: no cover - older clients only allow legacy names anyway

    def escape_metric_name(s: str, escaping: str = "underscores") -> str:
        return s

    def escape_label_name(s: str, escaping: str = "underscores") -> str:
        return s


__all__ = ["CONTENT_TYPE", "CachedPage", "PageRenderer", "Publication", "state_changed", "state_version"]

T = TypeVar("T")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_SPECIAL = {"inf": "+Inf", "-inf": "-Inf", "nan": "NaN"}


def _number(value: float) -> str:
    # repr() is the shortest text that reads back as the same float; Go's parser takes it as is.
    text = repr(value) if type(value) is float else repr(float(value))
    return _SPECIAL.get(text, text)


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _head(name: str, pairs: Iterable[tuple[str, str]]) -> str:
    """`name{a="x",b="y"} `: a sample line up to its value."""
    labels = ",".join(f'{escape_label_name(k)}="{_escape_value(v)}"' for k, v in pairs)
    return f"{escape_metric_name(name)}{{{labels}}} " if labels else f"{escape_metric_name(name)} "


# A collector's families (and an Info's or Enum's samples) are made anew each scrape, but their label sets are
# bounded (rank labels, kind, dim, probe names): their heads and headers are escaped once, not on every render.
@functools.lru_cache(maxsize=4096)
def _collected_head(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    return _head(name, pairs)


@functools.lru_cache(maxsize=1024)
def _header(name: str, kind: str, documentation: str) -> str:
    """HELP and TYPE lines, with generate_latest's munging from OpenMetrics types to the text format."""
    if kind == "counter":
        name += "_total"
    elif kind == "info":
        name, kind = name + "_info", "gauge"
    elif kind == "stateset":
        kind = "gauge"
    elif kind == "gaugehistogram":
        kind = "histogram"
    elif kind == "unknown":
        kind = "untyped"
    name = escape_metric_name(name)
    return f"# HELP {name} {_escape_help(documentation)}\n# TYPE {name} {kind}\n"


def _own(child: Any, cls: type) -> bool:
    """Whether `child` samples as `cls` does (no subclass override, no Gauge.set_function)."""
    own = getattr(type(child), "_child_samples", None)
    return own is getattr(cls, "_child_samples", None) and "_child_samples" not in vars(child)


class _Scalar:
    """A Counter or Gauge child: one line, one number."""

    __slots__ = ("child", "head", "value")

    def __init__(self, child: Any, head: str) -> None:
        self.child, self.head, self.value = child, head, child._value

    def read(self) -> float:
        return self.value.get()

    def format(self, value: float, out: list[str]) -> None:
        out.append(self.head + _number(value) + "\n")


class _Buckets:
    """A Histogram child: cumulative buckets, count, and sum (when no bound is negative)."""

    __slots__ = ("child", "heads", "count_head", "sum_head", "buckets", "total")

    def __init__(self, child: Any, name: str, pairs: list[tuple[str, str]]) -> None:
        self.child, self.buckets, self.total = child, child._buckets, child._sum
        bounds = child._upper_bounds
        self.heads = [_head(name + "_bucket", [*pairs, ("le", floatToGoString(b))]) for b in bounds]
        self.count_head = _head(name + "_count", pairs)
        self.sum_head = _head(name + "_sum", pairs) if bounds[0] >= 0 else None

    def read(self) -> tuple[list[float], float]:
        return [bucket.get() for bucket in self.buckets], self.total.get()

    def format(self, value: tuple[list[float], float], out: list[str]) -> None:
        counts, total = value
        accumulated = 0.0
        append = out.append
        for head, count in zip(self.heads, counts, strict=True):
            accumulated += count
            append(f"{head}{accumulated!r}\n")  # a count: finite, so repr() is the text format's number
        append(f"{self.count_head}{accumulated!r}\n")
        if self.sum_head is not None:
            append(f"{self.sum_head}{_number(total)}\n")


class _Samples:
    """Any other child (Info, Enum, Summary, a set_function gauge): its own samples, formatted."""

    __slots__ = ("child", "name", "pairs")

    def __init__(self, child: Any, name: str, pairs: list[tuple[str, str]]) -> None:
        self.child, self.name, self.pairs = child, name, pairs

    def read(self) -> list[Any]:
        return list(self.child._child_samples())

    def format(self, samples: list[Any], out: list[str]) -> None:
        for suffix, labels, value, timestamp, *_ in samples:
            if suffix == "_created":
                continue
            line = _collected_head(self.name + suffix, (*self.pairs, *labels.items())) + _number(value)
            out.append(line + (f" {int(float(timestamp) * 1000):d}\n" if timestamp is not None else "\n"))


def _child_renderer(child: Any, name: str, pairs: list[tuple[str, str]]) -> Any:
    try:
        if isinstance(child, Counter) and _own(child, Counter):
            return _Scalar(child, _head(name + "_total", pairs))
        if isinstance(child, Gauge) and _own(child, Gauge):
            return _Scalar(child, _head(name, pairs))
        if isinstance(child, Histogram) and _own(child, Histogram):
            return _Buckets(child, name, pairs)
    except AttributeError:  # another prometheus_client's internals: take the general path
        pass
    return _Samples(child, name, pairs)


class _Family:
    """A prometheus_client metric (a parent with labelled children, or one without labels)."""

    def __init__(self, metric: MetricWrapperBase) -> None:
        self.metric = metric
        self.header = _header(metric._name, metric._type or "untyped", metric._documentation)
        self.parent = bool(metric._is_parent())
        self.known: dict[tuple[str, ...], Any] = {}
        self.children: list[Any] = []  # the child objects the renderers below were made for, in order
        self.renderers: list[Any] = []
        self.scalars: list[Any] | None = None  # the value objects when every child is a _Scalar
        self.heads: list[str] = []  # and their heads
        # Gauge.set_function() replaces a child's sampling after its renderer was made: watched per render.
        self.gauge = isinstance(metric, Gauge)
        if not self.parent:
            self._follow([((), metric)])

    def read(self) -> list[Any]:
        """Every child's numbers now (the children followed first); `format` writes them."""
        if self.parent:
            metric = self.metric
            with metric._lock:
                children = list(metric._metrics.values())
            if children != self.children or self._turned():  # identity: a child added, removed, or made again
                with metric._lock:
                    self._follow([(tuple(key), child) for key, child in metric._metrics.items()])
        elif self._turned():
            self._follow([((), self.metric)])
        if self.scalars is not None:
            return [value.get() for value in self.scalars]
        return [renderer.read() for renderer in self.renderers]

    def format(self, values: list[Any], out: list[str]) -> None:
        out.append(self.header)
        if self.scalars is not None:
            out.extend([f"{head}{_number(value)}\n" for head, value in zip(self.heads, values, strict=True)])
        else:
            for renderer, value in zip(self.renderers, values, strict=True):
                renderer.format(value, out)

    def _turned(self) -> bool:
        """Whether a child rendered as a plain number has since been given a function (set_function)."""
        return self.gauge and any("_child_samples" in vars(r.child) for r in self.renderers if type(r) is _Scalar)

    def _follow(self, children: list[tuple[tuple[str, ...], Any]]) -> None:
        metric, known, current = self.metric, self.known, {}
        for values, child in children:
            renderer = known.get(values)
            stale = type(renderer) is _Scalar and "_child_samples" in vars(child)
            if renderer is None or renderer.child is not child or stale:
                renderer = _child_renderer(child, metric._name, list(zip(metric._labelnames, values, strict=True)))
            current[values] = renderer
        self.known = current  # children removed from the metric are forgotten here
        self.renderers = list(current.values())
        self.children = [renderer.child for renderer in self.renderers]
        scalar = all(isinstance(r, _Scalar) for r in self.renderers)
        self.scalars = [r.value for r in self.renderers] if scalar else None
        self.heads = [r.head for r in self.renderers] if scalar else []


def _render_collected(metric: Any, out: list[str]) -> None:
    """One family from a collector's collect(), as generate_latest writes it (minus `_created`)."""
    out.append(_header(metric.name, metric.type, metric.documentation))
    late: dict[str, list[str]] = {}
    for sample in metric.samples:
        suffix = sample.name[len(metric.name) :] if sample.name.startswith(metric.name) else None
        if suffix == "_created":
            continue
        line = _collected_head(sample.name, tuple(sorted(sample.labels.items()))) + _number(sample.value)
        line += f" {int(float(sample.timestamp) * 1000):d}\n" if sample.timestamp is not None else "\n"
        if suffix in ("_gsum", "_gcount"):  # gauge histograms: OpenMetrics-only samples, as gauges at the end
            late.setdefault(suffix, []).append(line)
        else:
            out.append(line)
    for suffix, lines in sorted(late.items()):
        out.append(_header(metric.name + suffix, "gauge", metric.documentation))
        out.extend(lines)


class Publication:
    """Values that one thread publishes together (a step's end: its global_step with the loss recorded in it),
    read whole by the page renderer without ever making the publisher wait.

        with publication:                    # the training thread: two integer stores, never blocks
            global_step.set(index)
        numbers = publication.read(read_all) # the metrics thread: read_all() again if a publication overlapped

    A sequence lock: the version is odd while a publication is under way and changes with each one; a read
    is kept only if the version was even before it and unchanged after it. Publications take microseconds,
    a read of the registry's numbers tens of them, so a read is rarely repeated. One publishing thread only
    (the stores are atomic under the GIL; two publishers could leave the version even mid-publication)."""

    __slots__ = ("_version",)

    #: A publication still under way after this long (a signal handler running inside it, on the training
    #: thread) does not hold the page back: it is read as it stands.
    PATIENCE_SECONDS = 0.5

    def __init__(self) -> None:
        self._version = 0

    def __enter__(self) -> None:
        self._version += 1

    def __exit__(self, *exc: object) -> None:
        self._version += 1

    def read(self, read: Callable[[], T]) -> T:
        """`read()`'s result from a moment no publication was under way."""
        deadline = None
        while True:
            before = self._version
            if not before & 1:
                result = read()
                if self._version == before:
                    return result
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.PATIENCE_SECONDS
            elif now > deadline:
                return read()
            time.sleep(0.0005 if before & 1 else 0)  # let the publisher finish (it needs the GIL)


class PageRenderer:
    """Renders a registry (or any collector) in the Prometheus text format; thread-safe.

    `consistent`: the `Publication` the recording side publishes values that belong together under (a step's
    end: its global_step with the loss recorded in it). The registry's own metrics are read through it, all at
    one moment, and formatted after; other collectors (probes, which may be slow) are collected before it."""

    def __init__(self, registry: CollectorRegistry | Any, consistent: Publication | None = None) -> None:
        self._registry = registry
        self._families: dict[Any, _Family] = {}
        self._lock = threading.Lock()
        self._consistent = consistent
        # A CollectorRegistry is walked collector by collector; anything else through collect().
        self._walk = all(hasattr(registry, a) for a in ("_lock", "_collector_to_names", "_target_info"))

    def _collectors(self) -> tuple[list[Any], Any]:
        registry = self._registry
        with registry._lock:
            collectors = list(registry._collector_to_names)
            target_info = registry._target_info_metric() if registry._target_info else None
        return collectors, target_info

    def render(self) -> bytes:
        """The whole page, UTF-8."""
        out: list[str] = []
        with self._lock:
            if not self._walk:
                for metric in self._registry.collect():
                    _render_collected(metric, out)
                return "".join(out).encode("utf-8")
            collectors, target_info = self._collectors()
            if target_info is not None:
                _render_collected(target_info, out)
            known, current = self._families, {}
            parts: list[list[str]] = []
            for collector in collectors:  # collectors first, in order: each part keeps its place on the page
                part: list[str] = []
                parts.append(part)
                family = known.get(collector)
                if family is None and isinstance(collector, MetricWrapperBase):
                    family = _Family(collector)
                if family is None:
                    for metric in collector.collect():
                        _render_collected(metric, part)
                    continue
                current[collector] = family
            families = [(current[c], part) for c, part in zip(collectors, parts, strict=True) if c in current]

            def numbers() -> list[list[Any]]:
                return [family.read() for family, _ in families]

            # Then every metric's numbers at one moment, formatted after.
            read = numbers() if self._consistent is None else self._consistent.read(numbers)
            for (family, part), values in zip(families, read, strict=True):
                family.format(values, part)
            self._families = current  # unregistered metrics are forgotten
            for part in parts:
                out.extend(part)
        return "".join(out).encode("utf-8")


_state_version = itertools.count(1)
_current_state = 0


def state_changed() -> None:
    """Something a scrape must not miss happened in this process (the run finished, an action settled,
    the run paused or resumed): the next request renders the page again, whatever its cache period."""
    global _current_state
    _current_state = next(_state_version)


def state_version() -> int:
    return _current_state


class CachedPage:
    """A rendered page kept for `seconds` (0: rendered on every request); thread-safe.

    Scrapes within one period share one render, so the scrape-time probes run at most once per
    period however often the page is fetched. Concurrent requests for a stale page wait for the
    one render instead of rendering it again. A render that raises is not cached. A page is never
    served older than the last `state_changed()` (`version`): after the run finishes, or an action
    settles, the next scrape shows it, so a rank's last page is never one from before its end.
    """

    def __init__(
        self,
        render: Callable[[], bytes],
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
        version: Callable[[], int] = state_version,
    ) -> None:
        if not seconds >= 0:
            raise ValueError(f"page cache seconds must be >= 0, got {seconds!r}")
        self._render, self._seconds, self._clock, self._version = render, seconds, clock, version
        self._page: bytes | None = None
        self._compressed: bytes | None = None
        self._rendered_at = 0.0
        self._rendered_version = -1
        self._lock = threading.Lock()

    def _fresh(self, now: float) -> bool:
        return (
            self._page is not None
            and now - self._rendered_at < self._seconds
            and self._rendered_version == self._version()
        )

    def peek(self, compressed: bool = False) -> bytes | None:
        """The page if it is fresh (and, if asked, already compressed), without waiting or rendering; else None."""
        if not self._lock.acquire(blocking=False):
            return None  # a render is under way
        try:
            if not self._fresh(self._clock()):
                return None
            return self._compressed if compressed else self._page
        finally:
            self._lock.release()

    def get(self, compressed: bool = False) -> bytes:
        """The page, fresh within the cache period; gzip-compressed when asked (compressed once per render)."""
        with self._lock:
            now = self._clock()
            if not self._fresh(now):
                version = self._version()  # read first: a change during the render renders again next time
                self._page, self._compressed = self._render(), None
                self._rendered_at, self._rendered_version = now, version
            page = self._page
            assert page is not None  # rendered above when missing
            if not compressed:
                return page
            if self._compressed is None:
                # Level 1: a tenth of level 9's CPU on these pages for most of its size reduction.
                self._compressed = gzip.compress(page, compresslevel=1, mtime=0)
            return self._compressed
