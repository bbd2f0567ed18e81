"""The sharded layout: the same rule groups split between shard Prometheus servers and one global server.

Past what one Prometheus holds, each shard scrapes a share of the ranks (targets split by node with
``hashmod``) and evaluates the per-rank reductions; a global Prometheus federates from every shard what its
rules read and evaluates every alert and every run-level recording. The split is derived from each rule's
expression, from the rule areas of :mod:`rankscope.mixin.rules` and the one config, so the single-server and
the sharded layouts cannot drift:

- a recording rule goes to the shards when each of its results depends on one node's series (every
  aggregation and vector match keeps ``node`` or ``instance``, as ``run_id, node, rank`` does) and it reads
  only scraped series, other shard recordings or its own earlier values: a shard holds every series of each
  node it scrapes, so it computes exactly what one server would. Run-level figures are built in two steps
  for this (rankscope.mixin.promql): each node's part on its shard, the run's from the nodes' parts on the
  global server, which then holds one series per node where it would hold one per rank;
- a shard record an area declares (``shard_records``) goes to the shards: each node's part of a run-level
  figure, and each rank's value only while something is wrong with it (over an alert's line, down, vanished, a
  hang candidate). A healthy run then federates one series per node for those figures and none per rank, and the
  global server's rules read no rank's series but the compute times the straggler's median needs;
- a record an area names in ``SHARD_EVALUATED`` goes to the shards although it matches ranks across nodes: the
  carried memory of the ranks whose last word was "finished" (read by the rank-down alert, present only for
  them). A shard forgets a rank's clean end when that rank serves again on one of its own nodes; a rank resumed
  on a node of another shard is remembered as finished there until the rank-down lookback ends (one server
  forgets it at once), so a rank-down alert for it within that lookback waits until then;
- a shard record gated on its run (the hang candidates: recorded only while the run may be hung) reads its
  shard's view of the run: the run-level records an area names in ``SHARD_VIEWS``, which each shard also
  evaluates over its own ranks under another name (:func:`view_name`). A shard's view of the run's last step is
  at least as old as the run's (its nodes are some of the run's), so the gate opens no later than one server's.
- every other rule goes to the global server: each alert, and every recording that compares or combines
  ranks (a run's median, a count of ranks in a phase), which needs the ranks of every shard;
- the global server federates (``match[]``) each series selector its rules read from a shard: the shard
  recordings by name, the scraped series with the matchers the rules use (local rank 0, rank 0).

A federated sample carries its timestamp, and Prometheus does not mark such a series stale when it vanishes
from the federation: it stays visible for the global server's lookback delta (5 minutes by default). A shard
record that comes and goes with its condition (an area's ``TRANSIENT``) is therefore read on the global server
through :func:`fresh`: only its samples at most three intervals old (the shard's evaluation, the federation's
scrape, one to spare). Every other crossing series exists for as long as its rank serves metrics.

Timing: a federated sample keeps the timestamp it was scraped (or recorded) at (``honor_timestamps``), so
rates and ``for`` durations on the global server measure the same time as on one server; the federation adds
at most one scrape interval before the global server's evaluation sees a sample, and a shard recording its
own evaluation interval before that. Shards carry no external label: ``honor_labels: true`` keeps every
series' own labels, so the alerts carry exactly the labels they carry on one server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rankscope.hang_threshold import duration_seconds
from rankscope.mixin import _yaml
from rankscope.mixin.config import Tunables
from rankscope.mixin.promql import recorded_names
from rankscope.mixin.rules import Area, areas, inlined

__all__ = [
    "Selector",
    "ShardedLayout",
    "federation_job",
    "fresh",
    "is_shard_local",
    "render",
    "selectors",
    "split",
    "view_name",
]

#: A grouping that keeps one of these labels groups within one shard: targets are split by node, and a target
#: (`instance`) is scraped by one shard.
LOCAL_LABELS = frozenset({"node", "instance"})
#: The federation scrape job's name on the global server.
FEDERATE_JOB = "rankscope-federate"
#: A shard's view of a run-level record is recorded under this prefix (see view_name).
VIEW_PREFIX = "shard_"
#: The shipped scrape and evaluation interval (prometheus/prometheus.yml).
DEFAULT_INTERVAL = "5s"

_AGGREGATORS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}  # fmt: skip
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "atan2", "inf", "nan", "start", "end"}
_KEEPING = {"by", "on"}
_DROPPING = {"without", "ignoring"}
_LISTING = {"group_left", "group_right"}
_TOKEN = re.compile(
    r"""(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)"""
    r"|(?P<number>\d[0-9a-zA-Z.]*)"
    r"|(?P<ident>[a-zA-Z_][a-zA-Z0-9_:]*)"
    r"|(?P<brace>\{)"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)",
    re.DOTALL,
)


@dataclass(frozen=True, order=True)
class Selector:
    """A series selector as an expression writes it: the metric name and its matchers (``le="0.1"``)."""

    name: str
    matchers: tuple[str, ...] = ()

    @property
    def recorded(self) -> bool:
        """A recorded series (``level:metric:operation``), not a scraped one."""
        return ":" in self.name

    def __str__(self) -> str:
        return self.name + ("{" + ", ".join(self.matchers) + "}" if self.matchers else "")

    def covers(self, other: Selector) -> bool:
        """Whether every series `other` selects is selected by this one too."""
        return self.name == other.name and set(self.matchers) <= set(other.matchers)


def _matchers(text: str, start: int) -> tuple[tuple[str, ...], int]:
    """The matchers of the braces opening at `start` and the index after them (strings may hold braces)."""
    found, current, i = [], "", start + 1
    while i < len(text) and text[i] != "}":
        string = _TOKEN.match(text, i)
        if string and string.lastgroup == "string":
            current += string.group()
            i = string.end()
            continue
        if text[i] == ",":
            found.append(current.strip())
            current = ""
        else:
            current += text[i]
        i += 1
    if i >= len(text):
        raise ValueError(f"unclosed {{ in {text!r}")
    found.append(current.strip())
    normal = tuple(sorted(re.sub(r"\s*(=~|!~|!=|=)\s*", r"\1", m) for m in found if m))
    return normal, i + 1


def _label_list(text: str, i: int) -> tuple[tuple[str, ...], int] | None:
    """The label list `( a, b )` at or after `i` (after blanks), or None if none opens there."""
    j = i
    while j < len(text) and text[j].isspace():
        j += 1
    if j >= len(text) or text[j] != "(":
        return None
    end = text.index(")", j)
    return tuple(label.strip() for label in text[j + 1 : end].split(",") if label.strip()), end + 1


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at `start` (strings may hold parentheses)."""
    depth, i = 0, start
    while i < len(text):
        token = _TOKEN.match(text, i)
        assert token is not None
        if token.group() == "(":
            depth += 1
        elif token.group() == ")":
            depth -= 1
            if depth == 0:
                return i
        i = token.end()
    raise ValueError(f"unbalanced ( in {text!r}")


def _scan(expr: str) -> tuple[list[Selector], list[tuple[str, tuple[str, ...]]]]:
    """Every series selector of a PromQL expression, and every grouping or matching clause (keyword, labels)."""
    found: list[Selector] = []
    clauses: list[tuple[str, tuple[str, ...]]] = []
    i = 0
    while i < len(expr):
        token = _TOKEN.match(expr, i)
        assert token is not None  # `other` matches any character
        kind, i = token.lastgroup, token.end()
        if kind == "brace":  # a selector without a metric name (`{__name__=~"..."}`): federated as written
            braces, i = _matchers(expr, token.start())
            found.append(Selector("", braces))
            continue
        if kind != "ident":
            continue
        word = token.group()
        if word in _KEEPING | _DROPPING | _LISTING:
            labels = _label_list(expr, i)
            if labels is not None:
                clauses.append((word, labels[0]))
                i = labels[1]
            continue
        if word in _AGGREGATORS:
            if expr[i:].lstrip().startswith("("):  # `sum(x)` or `sum(x) by (a)`: look past the arguments
                after = _TOKEN.match(expr, _closing(expr, expr.index("(", i)) + 1)
                while after is not None and after.lastgroup == "space":
                    after = _TOKEN.match(expr, after.end())
                if after is None or after.group() not in ("by", "without"):
                    clauses.append(("by", ()))  # aggregates every series into one
            continue
        if word.lower() in _KEYWORDS:  # PromQL reads Inf and NaN in any case
            continue
        rest = expr[i:].lstrip()
        if rest.startswith("("):  # a function call
            continue
        matchers: tuple[str, ...] = ()
        if rest.startswith("{"):
            matchers, i = _matchers(expr, len(expr) - len(rest))
        found.append(Selector(word, matchers))
    return found, clauses


def selectors(expr: str) -> set[Selector]:
    """The series selectors an expression reads (metric name and matchers, as written)."""
    return set(_scan(expr)[0])


def is_shard_local(expr: str) -> bool:
    """Whether each result series of `expr` depends on the series of one node (or one target) only, so that
    the shard scraping that node computes it as one server would: every ``by``/``on`` list keeps ``node``
    (or ``instance``), no ``without``/``ignoring`` list drops ``node``, and no aggregation takes every series."""
    for keyword, labels in _scan(expr)[1]:
        if keyword in _KEEPING and not LOCAL_LABELS & set(labels):
            return False
        if keyword in _DROPPING and "node" in labels:
            return False
    return True


@dataclass(frozen=True)
class ShardedLayout:
    """The rule groups of each server (group dicts as :func:`rankscope.mixin.rules.groups` writes them, by
    area file name) and the selectors the global server federates from the shards."""

    shard_groups: dict[str, dict[str, Any]]
    global_groups: dict[str, dict[str, Any]]
    federated: tuple[Selector, ...]

    @property
    def shard_records(self) -> set[str]:
        return {rule["record"] for group in self.shard_groups.values() for rule in group["rules"]}


def _group(area: Area, rules: list[dict[str, Any]], t: Tunables) -> dict[str, Any]:
    group: dict[str, Any] = {"name": area.group}
    if interval := area.interval(t):
        group["interval"] = interval
    group["rules"] = rules
    return group


def _minimal(found: set[Selector]) -> tuple[Selector, ...]:
    """The selectors no other selector of the set already covers, sorted."""
    return tuple(sorted(s for s in found if not any(o != s and o.covers(s) for o in found)))


def view_name(name: str) -> str:
    """The name a run-level record's shard view is recorded under on each shard (``run:x:y`` -> ``shard_run:x:y``):
    the run as that shard sees it, over its own ranks. Never federated: the global server records the run's own."""
    return VIEW_PREFIX + name


def fresh(name: str, seconds: float) -> str:
    """The samples of the federated series `name` at most `seconds` old: a federated sample keeps its timestamp, and
    Prometheus keeps a vanished series' last one for its lookback delta (5 minutes), never marking it stale."""
    return f"{name} and (timestamp({name}) > time() - {seconds:g})"


def _renamed_reads(expr: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        expr = re.sub(rf"(?<![\w:]){re.escape(old)}(?![\w:])", new, expr)
    return expr


def split(t: Tunables, interval: str = DEFAULT_INTERVAL) -> ShardedLayout:
    """The rule pack of `t`, split between the shards and the global server (`interval`: the scrape and evaluation
    interval of both, unless `t.evaluation_interval` sets the rules' own)."""
    shard_groups: dict[str, dict[str, Any]] = {}
    global_groups: dict[str, dict[str, Any]] = {}
    on_shard: set[str] = set()
    every = areas(t)
    views = {name: view_name(name) for area in every for name in area.shard_views}
    shard_evaluated = {name for area in every for name in area.shard_evaluated}

    def shard_can(rule: dict[str, Any], gated: bool = False) -> bool:
        read = selectors(rule["expr"])
        # A record that carries its own last value forward reads itself: on the shard, that is its shard's copy.
        own = {*on_shard, rule["record"]}
        if not all(not s.recorded or s.name in own for s in read):
            return False
        # A shard record gated on its shard's view of its run joins the run's view by design, and a record the
        # areas have shards evaluate over their own ranks matches across nodes by design.
        return (
            is_shard_local(rule["expr"])
            or rule["record"] in shard_evaluated
            or (gated and any(s.name in views.values() for s in read))
        )

    on_global: set[str] = set()
    for area in every:  # in dependency order: a record's inputs are placed before it
        shard_rules: list[dict[str, Any]] = []
        global_rules: list[dict[str, Any]] = []
        records = area.sharded_module_records(t)
        # The shard views first (the shard records' gates read them), as one server writes them: over the shard's
        # own scraped series.
        for rule in area.module.records(t):
            if rule["record"] in views:
                shard_rules.append({"record": views[rule["record"]], "expr": _renamed_reads(rule["expr"], views)})
                on_shard.add(views[rule["record"]])
        # The shard records, then the others, each once what it reads is placed (a shard record may read a record
        # of its own area, and that one a shard record). Where each goes: True, the shards' (declared so); None,
        # the global server's (declared so); False, wherever what it reads allows.
        pending: list[tuple[dict[str, Any], bool | None]] = [
            ({**r, "expr": _renamed_reads(r["expr"], views)}, True) for r in area.shard_records(t)
        ]
        pending += [(rule, None) for rule in area.global_records(t)]  # None: the global server's by declaration
        pending += [(rule, rule["record"] in shard_evaluated) for rule in records]
        while pending:
            placed = on_shard | on_global
            ready = next(
                (
                    i
                    for i, (rule, _) in enumerate(pending)
                    if not recorded_names(rule["expr"]) - placed - {rule["record"]}
                ),
                None,
            )
            if ready is None:
                raise ValueError(
                    f"records of {area.group} read each other in a cycle: {[r['record'] for r, _ in pending]}"
                )
            rule, declared = pending.pop(ready)
            if declared and not shard_can(rule, gated=True):
                raise ValueError(f"shard record {rule['record']} reads what its shard cannot see: {rule['expr']!r}")
            if declared or (declared is not None and shard_can(rule)):
                shard_rules.append(rule)
                on_shard.add(rule["record"])
            else:
                global_rules.append(rule)
                on_global.add(rule["record"])
        global_rules += [alert.to_rule(t) for alert in area.alerts(t)]
        if shard_rules:
            shard_groups[area.file_name] = _group(area, shard_rules, t)
        if global_rules:
            global_groups[area.file_name] = _group(area, global_rules, t)
    # The global server reads a transient shard record's fresh samples only: within its group's interval (the
    # shard's evaluation), one interval of the federation's scrape, and its group's interval to spare.
    scrape = duration_seconds(interval)
    freshened = {
        name: fresh(name, 2 * duration_seconds(area.interval(t) or interval) + scrape)
        for area in every
        for name in (*area.transient, *area.shard_evaluated)
    }
    for group in global_groups.values():
        group["rules"] = [{**rule, "expr": inlined(rule["expr"], freshened)} for rule in group["rules"]]
    read_on_global = {s for group in global_groups.values() for rule in group["rules"] for s in selectors(rule["expr"])}
    unknown = sorted(s.name for s in read_on_global if s.recorded and s.name not in on_global | on_shard)
    if unknown:
        raise ValueError(f"global rules read series no rule records: {unknown}")
    if not_views := sorted(s.name for s in read_on_global if s.name in views.values()):
        raise ValueError(f"global rules read a shard's view of its run: {not_views}")
    federated = {
        Selector(s.name) if s.recorded else s for s in read_on_global if not (s.recorded and s.name in on_global)
    }
    return ShardedLayout(shard_groups, global_groups, _minimal(federated))


# --- the files -------------------------------------------------------------------------------------------


def federation_job(layout: ShardedLayout, shards: list[str], interval: str) -> dict[str, Any]:
    """The global server's scrape job that federates `layout.federated` from `shards` (host:port each)."""
    return {
        "job_name": FEDERATE_JOB,
        # The series' own labels (job, instance, run_id, node, rank) win over the federation target's.
        "honor_labels": True,
        "metrics_path": "/federate",
        "scrape_interval": interval,
        "params": {"match[]": [str(s) for s in layout.federated]},
        "static_configs": [{"targets": shards}],
        # A shard's recorded series has no job label, and the scrape would give it this job's: a label the
        # same series does not carry on one server (an alert reading it would carry it too).
        "metric_relabel_configs": [
            {"source_labels": ["job"], "regex": FEDERATE_JOB, "target_label": "job", "replacement": ""}
        ],
    }


def shard_scrape_job(index: int, count: int, targets: str) -> dict[str, Any]:
    """The ranks' scrape job of shard `index` of `count`: the trainers' file_sd targets whose node hashes to it."""
    return {
        "job_name": "rankscope",
        "honor_labels": True,
        "file_sd_configs": [{"files": [targets], "refresh_interval": "1m"}],
        "relabel_configs": [
            # Every rank of a node on one shard: a node's ranks come and go together.
            {"source_labels": ["node"], "modulus": count, "target_label": "__tmp_shard", "action": "hashmod"},
            {"source_labels": ["__tmp_shard"], "regex": str(index), "action": "keep"},
        ],
    }


#: Where the files go, relative to --out.
SHARDED_DIR = "prometheus/sharded"
#: The shards' address in the generated configs (``{index}``), and the trainers' target files.
SHARD_ADDRESS = "prometheus-shard-{index}:9090"
TARGET_FILES = "/etc/prometheus/targets/rankscope-*.json"


def render(t: Tunables, shards: int, scrape_interval: str, alertmanager: str) -> dict[str, str]:
    """Relative path (under --out) -> text of every file of the sharded layout for `shards` shards."""
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    layout = split(t, scrape_interval)
    header = _yaml.HEADER
    files: dict[str, str] = {}
    for name, group in layout.shard_groups.items():
        files[f"{SHARDED_DIR}/shard/rules/{name}"] = header + _yaml.dump({"groups": [group]})
    for name, group in layout.global_groups.items():
        files[f"{SHARDED_DIR}/global/rules/{name}"] = header + _yaml.dump({"groups": [group]})
    addresses = [SHARD_ADDRESS.format(index=i) for i in range(shards)]
    job = federation_job(layout, addresses, scrape_interval)
    files[f"{SHARDED_DIR}/global/federate.yml"] = header + _yaml.dump({"scrape_configs": [job]})
    timing = {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval}
    files[f"{SHARDED_DIR}/global/prometheus.yml"] = header + _yaml.dump(
        {
            "global": timing,
            "rule_files": ["rules/*.yml"],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
            "scrape_configs": [job],
        }
    )
    for index in range(shards):
        files[f"{SHARDED_DIR}/shard/prometheus-{index}.yml"] = header + _yaml.dump(
            {
                "global": timing,
                "rule_files": ["rules/*.yml"],
                "scrape_configs": [shard_scrape_job(index, shards, TARGET_FILES)],
            }
        )
    return files
