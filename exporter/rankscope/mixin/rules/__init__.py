"""Recording and alerting rules, one module per area, one rule group (and file) per module.

Each area module here (``training.py`` -> group ``rankscope.training`` in ``prometheus/rules/training.yml``,
tested by ``prometheus/tests/training_test.yml``) defines two functions of the config's
:class:`~rankscope.mixin.config.Tunables`:

- ``records(t) -> list[dict]``: the group's recording rules, in dependency order;
- ``alerts(t) -> list[Alert]``: its alerts, evaluated after its records in the same pass;
- optionally ``shard_records(t) -> list[dict]``: per-rank or per-node values that only the sharded layout records
  (on its shards, so that the global server federates one series per rank or node where its rules would read
  several per rank). One server computes each inside the rules that read it instead: recording a value for
  every rank writes thousands of samples per evaluation, which at 4096 ranks costs more than the alerts that
  read it (benchmarks.scale). Both layouts evaluate the same expression, so the alerts are the same;
- optionally ``SHARD_VIEWS``: names of its run-level records that each shard also evaluates over its own ranks,
  under another name (rankscope.mixin.layout), for shard records that record only while their run may need
  them (a gate: one server reads its run-level record there);
- optionally ``TRANSIENT``: its shard records that are present only while their condition holds; the global
  server reads only their fresh samples;
- optionally ``SHARD_EVALUATED``: its records that each shard evaluates over its own ranks although they match
  ranks across nodes (rankscope.mixin.layout says what that changes);
- optionally ``SLOW = True``: its group is evaluated every ``slow_interval`` (its rates span minutes and its alerts
  wait ten minutes or more: see :attr:`~rankscope.mixin.config.Tunables.slow_interval`);
- optionally ``sharded_forms(t) -> dict[str, str]``: records the sharded layout builds another way (a run's mean
  from its nodes' sums and counts, where one server takes the mean in one read): record name -> expression;
  and ``global_records(t) -> list[dict]``: records only the sharded layout's global server records, for those
  forms (a value several of them read, which one server reads inside each expression to keep its recording
  levels). tests/test_sharded_equivalence.py holds both layouts to the same alerts.

Areas are found by listing this package (modules starting with ``_`` are skipped), and the groups are
ordered so that a group comes after every group whose recorded series it reads. Prometheus evaluates
groups side by side and reports each one's evaluation time; a series read from another group is one
evaluation old, which :func:`rankscope.mixin.promql.recording_depth` bounds.

The rules are built for runs of thousands of ranks: every rate over a rank's series is computed once
per evaluation; quantiles are built from the run's bucket rates and only where a panel or an alert reads
them (never per rank); where DDP makes every rank's value the same, one rank per node is read
(``ONE_PER_NODE``); range functions over long windows read run-level recorded series, never every
rank's; and no alert reads a series more than two recording levels above the scraped data.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import textwrap
from dataclasses import dataclass, field, replace
from functools import cache
from types import ModuleType
from typing import Any

from rankscope.hang_threshold import duration_seconds
from rankscope.mixin import _yaml
from rankscope.mixin.config import Tunables
from rankscope.mixin.promql import RUN, RUN_ENDED, recorded_names

__all__ = ["Alert", "Area", "alerts", "areas", "groups", "inlined", "recording_rules", "render", "shard_expressions"]

#: The prefix of every group's name.
GROUP_PREFIX = "rankscope."
#: How alert descriptions name a rank.
RANK_TEXT = "rank {{ $labels.rank }} (node {{ $labels.node }}) of run {{ $labels.run_id }}"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    action: str = ""
    ended_runs: bool = False
    """Whether it may fire for a run that has ended (RUN_ENDED: it finished, or no rank of it serves metrics):
    only the alert for a rank that vanished does. Every other alert of an ended run resolves, and old runs in
    the TSDB (a Prometheus restarted over its data) raise nothing."""
    parameters: dict[str, str] = field(default_factory=dict)
    """Action parameters for the trainer, as annotations (rankscope.control.alerts reads them)."""

    def to_rule(self, t: Tunables) -> dict[str, Any]:
        expr = self.expr
        if not self.ended_runs:
            expr = f"(\n{textwrap.indent(expr, '  ')}\n)\nunless on ({RUN})\n{RUN_ENDED}"
        rule: dict[str, Any] = {"alert": self.name, "expr": expr}
        if self.for_ not in ("0s", "0m"):
            rule["for"] = self.for_
        labels = {"severity": self.severity}
        if self.action:
            labels["action"] = self.action
        rule["labels"] = labels
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": t.runbook_url.replace("{alert}", self.name.lower()),
            **self.parameters,
        }
        return rule


@dataclass(frozen=True)
class Area:
    """One area module: its name (the group's last part and the file's stem) and its rules."""

    name: str
    module: ModuleType

    @property
    def group(self) -> str:
        return GROUP_PREFIX + self.name

    @property
    def file_name(self) -> str:
        return f"{self.name}.yml"

    def records(self, t: Tunables) -> list[dict[str, str]]:
        """The recording rules one server evaluates (each reads its shard records inline)."""
        inline = shard_expressions(t)
        return [{**rule, "expr": inlined(rule["expr"], inline)} for rule in self.module.records(t)]

    def shard_records(self, t: Tunables) -> list[dict[str, str]]:
        """The recording rules only the sharded layout's shards evaluate (read only scraped series)."""
        return list(getattr(self.module, "shard_records", lambda _: [])(t))

    @property
    def slow(self) -> bool:
        """Whether its group is evaluated every `slow_interval`."""
        return bool(getattr(self.module, "SLOW", False))

    def interval(self, t: Tunables) -> str:
        """Its group's `interval` ("": the server's evaluation interval). A slow area takes `slow_interval` only
        while each of its alerts waits at least ten times as long (rules tuned to fire in seconds evaluate it like
        every other group: the slow interval may save CPU, never delay an alert by more than a tenth of its
        `for`), and never one shorter than `evaluation_interval`."""
        if not (self.slow and t.slow_interval):
            return t.evaluation_interval
        slow = duration_seconds(t.slow_interval)
        if any(10 * slow > duration_seconds(alert.for_) for alert in self.alerts(t)):
            return t.evaluation_interval
        if t.evaluation_interval and duration_seconds(t.evaluation_interval) > slow:
            return t.evaluation_interval
        return t.slow_interval

    @property
    def shard_views(self) -> tuple[str, ...]:
        """Its run-level records each shard also evaluates over its own ranks (for its shard records' gates)."""
        return tuple(getattr(self.module, "SHARD_VIEWS", ()))

    @property
    def shard_evaluated(self) -> tuple[str, ...]:
        """Its records each shard evaluates over its own ranks although they match ranks across nodes."""
        return tuple(getattr(self.module, "SHARD_EVALUATED", ()))

    @property
    def transient(self) -> tuple[str, ...]:
        """Its shard records that are present only while their condition holds."""
        return tuple(getattr(self.module, "TRANSIENT", ()))

    def alerts(self, t: Tunables) -> list[Alert]:
        return list(self.module.alerts(t))

    def sharded_records(self, t: Tunables) -> list[dict[str, str]]:
        """The recording rules of the sharded layout: the shard records first (they read only scraped series),
        then the others as written (or in their sharded form), reading the shard records by name."""
        return self.shard_records(t) + self.global_records(t) + self.sharded_module_records(t)

    def global_records(self, t: Tunables) -> list[dict[str, str]]:
        """The recording rules only the sharded layout's global server evaluates (for its sharded forms)."""
        return list(getattr(self.module, "global_records", lambda _: [])(t))

    def sharded_module_records(self, t: Tunables) -> list[dict[str, str]]:
        """The area's own records as the sharded layout evaluates them: each in its sharded form where it has one."""
        forms: dict[str, str] = getattr(self.module, "sharded_forms", lambda _: {})(t)
        return [{**rule, "expr": forms.get(rule["record"], rule["expr"])} for rule in self.module.records(t)]

    def rules(self, t: Tunables) -> list[dict[str, Any]]:
        """The group's rules on one server."""
        inline = shard_expressions(t)
        return self.records(t) + [_inlined_alert(alert, inline).to_rule(t) for alert in self.alerts(t)]


def shard_expressions(t: Tunables) -> dict[str, str]:
    """Every shard record's name -> its expression, with the shard records it reads (listed before it) inlined."""
    found: dict[str, str] = {}
    for area in _modules():
        for rule in area.shard_records(t):
            found[rule["record"]] = inlined(rule["expr"], found)
    return found


def inlined(expr: str, inline: dict[str, str]) -> str:
    """`expr` with each series name of `inline` replaced by its expression, in parentheses (its own, or those
    the name stands in), indented under its line. A name read with matchers or over a range has no expression
    to stand for it: refused."""
    for name, body in inline.items():
        expr = _inline_one(expr, name, body)
    return expr


def _inline_one(expr: str, name: str, body: str) -> str:
    def replace(match: re.Match[str]) -> str:
        if expr[match.end() :].lstrip()[:1] in ("{", "["):
            raise ValueError(f"{name} is read with matchers or a range; only a plain read can be inlined: {expr!r}")
        line = expr[expr.rfind("\n", 0, match.start()) + 1 :]
        margin = line[: len(line) - len(line.lstrip())]
        inner = f"(\n{textwrap.indent(body, margin + '  ')}\n{margin})"
        if match[1] and match[2]:  # it stands in parentheses already
            return inner
        return f"{match[1] or ''}{inner}{match[2] or ''}"

    return re.sub(rf"(?<![\w:])(\(\s*)?{re.escape(name)}(?![\w:])(\s*\))?", replace, expr)


def _inlined_alert(alert: Alert, inline: dict[str, str]) -> Alert:
    return replace(alert, expr=inlined(alert.expr, inline))


@cache
def _modules() -> tuple[Area, ...]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            found.append(Area(info.name, importlib.import_module(f"{__name__}.{info.name}")))
    return tuple(found)


def areas(t: Tunables | None = None) -> list[Area]:
    """Every area, each after the areas whose recorded series it reads (then by name)."""
    t = t or Tunables()
    pending = list(_modules())
    made = {area.name: {rule["record"] for rule in area.records(t)} for area in pending}
    reads = {
        area.name: {n for rule in area.rules(t) for n in recorded_names(rule["expr"])} - made[area.name]
        for area in pending
    }
    ordered: list[Area] = []
    while pending:
        done = {n for area in ordered for n in made[area.name]}
        ready = [area for area in pending if not reads[area.name] - done]
        if not ready:
            left = {area.name: sorted(reads[area.name] - done) for area in pending}
            raise ValueError(f"rule areas read series no area records (or read each other's in a cycle): {left}")
        ordered.append(ready[0])
        pending.remove(ready[0])
    return ordered


def groups(t: Tunables) -> list[dict[str, Any]]:
    """Every rule group, in evaluation order."""
    found = []
    for area in areas(t):
        group: dict[str, Any] = {"name": area.group}
        if interval := area.interval(t):
            group["interval"] = interval
        group["rules"] = area.rules(t)
        found.append(group)
    return found


def alerts(t: Tunables) -> list[Alert]:
    """Every alert, area by area."""
    return [alert for area in areas(t) for alert in area.alerts(t)]


def recording_rules(t: Tunables) -> list[dict[str, str]]:
    """Every recording rule, area by area (each after the series it reads)."""
    return [rule for area in areas(t) for rule in area.records(t)]


def render(t: Tunables) -> dict[str, str]:
    """File name -> YAML text of every rule file (one group each)."""
    by_name = {group["name"]: group for group in groups(t)}
    return {area.file_name: _yaml.HEADER + _yaml.dump({"groups": [by_name[area.group]]}) for area in areas(t)}
