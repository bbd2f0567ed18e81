"""``rankscope-mixin``: write (or check) the whole rule pack from the config.

    rankscope-mixin                                   # rewrite the repository's files (run from its root)
    rankscope-mixin --check                           # exit 1 if a committed file differs from the output
    rankscope-mixin --set divergence_action=rollback --out DIR --kubernetes
    rankscope-mixin --layout sharded --shards 4 --out DIR  # shard and global servers (rankscope.mixin.layout)

Writes, under --out (default: the current directory), prometheus/rules/<area>.yml,
grafana/dashboards/*.json (needs the `mixin` extra), alertmanager/alertmanager.yml and, with
--kubernetes, kubernetes/prometheusrule.yaml and kubernetes/grafana-dashboards.yaml.
With --layout sharded it writes only prometheus/sharded/: the rules each shard Prometheus evaluates
(shard/rules/), a config per shard (shard/prometheus-<i>.yml), and the global server's rules
(global/rules/), federation job (global/federate.yml) and config (global/prometheus.yml).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from rankscope.mixin import _yaml, alertmanager, kubernetes, layout, rules
from rankscope.mixin.config import Tunables, apply_overrides

PROG = "rankscope-mixin"
RULES_DIR = Path("prometheus") / "rules"
DASHBOARDS_DIR = Path("grafana") / "dashboards"
ALERTMANAGER_DIR = Path("alertmanager")
KUBERNETES_DIR = Path("kubernetes")
LAYOUTS = ("single", "sharded")
#: The sharded layout's rule directories (and the single layout's), whose stale generated files are removed.
SHARDED_RULE_DIRS = (Path(layout.SHARDED_DIR) / "shard" / "rules", Path(layout.SHARDED_DIR) / "global" / "rules")
#: The shipped scrape and evaluation interval (prometheus/prometheus.yml) and Alertmanager address.
SCRAPE_INTERVAL = "5s"
ALERTMANAGER = "alertmanager:9093"


class MissingExtra(RuntimeError):
    """The dashboards need the grafana-foundation-sdk (the `mixin` extra)."""


def dashboards(t: Tunables) -> dict[str, str]:
    try:
        from rankscope.mixin.dashboards import generate
    except ImportError as exc:
        raise MissingExtra(f"dashboards need the mixin extra (pip install 'rankscope[mixin]'): {exc}") from None
    return generate.render(t)


def outputs(t: Tunables, *, with_kubernetes: bool = False, with_dashboards: bool = True) -> dict[Path, str]:
    """Relative path -> text of every file the command writes."""
    boards = dashboards(t) if with_dashboards else {}
    found = {RULES_DIR / name: text for name, text in rules.render(t).items()}
    found |= {DASHBOARDS_DIR / name: text for name, text in boards.items()}
    found |= {ALERTMANAGER_DIR / name: text for name, text in alertmanager.render(t).items()}
    if with_kubernetes:
        found |= {KUBERNETES_DIR / n: text for n, text in kubernetes.render(rules.groups(t), boards).items()}
    return found


def sharded_outputs(t: Tunables, shards: int) -> dict[Path, str]:
    """Relative path -> text of every file of the sharded layout (``--layout sharded``)."""
    return {Path(name): text for name, text in layout.render(t, shards, SCRAPE_INTERVAL, ALERTMANAGER).items()}


def _obsolete(out: Path, written: dict[Path, str], rule_dirs: tuple[Path, ...] = (RULES_DIR,)) -> list[Path]:
    """Generated rule files under `out` that the rule areas no longer produce (a renamed or removed area)."""
    return [
        path
        for rule_dir in rule_dirs
        for path in sorted((out / rule_dir).glob("*.yml"))
        if path.relative_to(out) not in written and path.read_text().startswith(_yaml.HEADER.splitlines()[0])
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="directory to write under (default: .)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a tunable of rankscope.mixin.config (repeatable; NAME may be a pattern such as '*_for')",
    )
    parser.add_argument("--check", action="store_true", help="only check that --out holds the generated files")
    parser.add_argument("--kubernetes", action="store_true", help="also the PrometheusRule and dashboard ConfigMaps")
    parser.add_argument("--print-tunables", action="store_true", help="print the effective tunables and exit")
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="single",
        help="single: one Prometheus (default); sharded: only prometheus/sharded/ (shards and a global server)",
    )
    parser.add_argument("--shards", type=int, default=2, help="how many shard servers --layout sharded configures")
    args = parser.parse_args(argv)
    if args.shards < 1:
        print(f"{PROG}: --shards must be at least 1, got {args.shards}", file=sys.stderr)
        return 2
    if args.layout == "sharded" and args.kubernetes:
        print(f"{PROG}: --kubernetes writes the single layout's resources; leave it out with --layout sharded",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        tunables = apply_overrides(Tunables(), args.overrides)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.print_tunables:
        for name, value in asdict(tunables).items():
            print(f"{name}={value}")
        return 0
    rule_dirs: tuple[Path, ...] = (RULES_DIR,)
    if args.layout == "sharded":
        files, rule_dirs = sharded_outputs(tunables, args.shards), SHARDED_RULE_DIRS
        return _check(args.out, files, rule_dirs) if args.check else _write(args.out, files, rule_dirs)
    try:
        files = outputs(tunables, with_kubernetes=args.kubernetes)
    except MissingExtra as exc:
        if args.check:  # the committed dashboards cannot be checked without the SDK
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        print(f"{PROG}: {exc}; writing the rules and routes only", file=sys.stderr)
        files = outputs(tunables, with_kubernetes=args.kubernetes, with_dashboards=False)
    return _check(args.out, files, rule_dirs) if args.check else _write(args.out, files, rule_dirs)


def _check(out: Path, files: dict[Path, str], rule_dirs: tuple[Path, ...]) -> int:
    stale = [str(out / p) for p, text in files.items() if not _same(out / p, text)]
    stale += [f"{p} (no area generates it)" for p in _obsolete(out, files, rule_dirs)]
    if stale:
        print(f"{PROG}: stale files (run {PROG}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


def _write(out: Path, files: dict[Path, str], rule_dirs: tuple[Path, ...]) -> int:
    for path in _obsolete(out, files, rule_dirs):
        path.unlink()
    for relative, text in files.items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not _same(path, text):
            path.write_text(text)
    return 0


def _same(path: Path, text: str) -> bool:
    return path.is_file() and path.read_text() == text


if __name__ == "__main__":
    sys.exit(main())
