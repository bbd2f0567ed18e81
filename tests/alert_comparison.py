"""Two rule sets evaluated side by side by the real `promtool` over a unit test's input series, and their
alerts compared at every evaluation.

The reference rules are renamed (``old_`` before every recorded series, ``Old`` before every alert, a prefix
before every group) so that they load beside the rules under test; at every evaluation the two sets of
``ALERTS`` (pending and firing, every label) must be equal. tests/test_rule_equivalence.py compares the
current rules with an earlier revision's; tests/test_sharded_equivalence.py the sharded layout with one
server's.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import yaml
from rankscope.mixin.promql import recorded_names

from tests.support import binary

OLD_ALERT = "Old"
OLD_RECORD = "old_"
_RECORD = re.compile(r"\b([a-z_]+:[a-zA-Z0-9_]+:[a-zA-Z0-9_]+)\b")


def renamed(text: str, group_prefix: str, rename_series: bool = True) -> str:
    """A rule file with every group renamed (`group_prefix`) and, with `rename_series`, every recorded series
    and alert too, so that it loads beside another copy of the same rules."""
    document = yaml.safe_load(text)
    for group in document["groups"]:
        group["name"] = group_prefix + group["name"]
        if not rename_series:
            continue
        for rule in group["rules"]:
            rule["expr"] = _RECORD.sub(lambda m: OLD_RECORD + m.group(1), rule["expr"])
            if "record" in rule:
                rule["record"] = OLD_RECORD + rule["record"]
            else:
                rule["alert"] = OLD_ALERT + rule["alert"]
    return yaml.safe_dump(document, sort_keys=False)


def dependency_order(paths: Iterable[Path]) -> list[str]:
    """Group names, each after the groups whose recorded series it reads (as rankscope-mixin orders them)."""
    groups = [g for path in paths for g in yaml.safe_load(path.read_text())["groups"]]
    made = {g["name"]: {r["record"] for r in g["rules"] if "record" in r} for g in groups}
    reads = {g["name"]: {n for r in g["rules"] for n in recorded_names(r["expr"])} - made[g["name"]] for g in groups}
    ordered: list[str] = []
    pending = sorted(made)
    while pending:
        done = {n for name in ordered for n in made[name]}
        ready = [name for name in pending if not reads[name] - done]
        assert ready, f"rule groups read each other's series in a cycle: {pending}"
        ordered.append(ready[0])
        pending.remove(ready[0])
    return ordered


def alert_names(paths: Iterable[Path]) -> set[str]:
    """Every alert of the rule files, without the reference rules' prefix."""
    return {
        rule["alert"].removeprefix(OLD_ALERT)
        for path in paths
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }


def difference(compared: Iterable[str]) -> str:
    """An expression of the reference alerts under their own names, less the tested ones, and the other way
    round: nothing at any evaluation."""
    names = "|".join(sorted(compared))
    old = (
        f'label_replace(ALERTS{{alertname=~"{OLD_ALERT}({names})"}}, "alertname", "$1", "alertname", "{OLD_ALERT}(.+)")'
    )
    new = f'ALERTS{{alertname=~"{names}"}}'
    return f"({old} unless {new}) or ({new} unless {old})"


def _seconds(duration: str) -> int:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total = 0.0
    for number, unit in re.findall(r"(\d+)(ms|s|m|h|d)", duration):
        total += int(number) * units[unit]
    return int(total)


def _series_length(values: str) -> int:
    """How many samples a promtool `values` string holds ('1+2x3' is 4, '_x5' is 6, 'stale' is 1)."""
    count = 0
    for term in values.split():
        expanded = re.fullmatch(r".*x(\d+)", term)
        count += int(expanded.group(1)) + 1 if expanded else 1
    return count


def comparison_file(
    unit_test: Path, workdir: Path, reference: list[Path], tested: list[Path], compared: set[str]
) -> Path:
    """A promtool test file: `unit_test`'s input series under the `reference` rule files (renamed) and the
    `tested` ones, the alerts `compared` compared at every evaluation."""
    original = yaml.safe_load(unit_test.read_text())
    expression = difference(compared)
    every = original.get("evaluation_interval", "1m")
    step = _seconds(every)
    tests = []
    for group in original["tests"]:
        interval = _seconds(group.get("interval", every))
        last = max(_series_length(s["values"]) for s in group["input_series"]) * interval
        checks = [{"expr": expression, "eval_time": f"{t}s", "exp_samples": []} for t in range(0, last + 1, step)]
        tests.append({"interval": group.get("interval", every), "input_series": group["input_series"],
                      "promql_expr_test": checks})  # fmt: skip
    document = {
        "rule_files": [str(p) for p in reference + tested],
        "evaluation_interval": every,
        "group_eval_order": dependency_order(reference) + dependency_order(tested),
        "tests": tests,
    }
    path = workdir / unit_test.name
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def run_comparison(path: Path) -> tuple[int, str]:
    """promtool's exit status and output on a comparison file."""
    result = subprocess.run([binary("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                            cwd=path.parent, timeout=600)  # fmt: skip
    return result.returncode, result.stdout + result.stderr
