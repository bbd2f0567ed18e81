"""``rankscope-mixin``: write (or check) the whole rule pack from the config.

    rankscope-mixin                                   # rewrite the repository's files (run from its root)
    rankscope-mixin --check                           # exit 1 if a committed file differs from the output
    rankscope-mixin --set divergence_action=rollback --out DIR --kubernetes

Writes, under --out (default: the current directory), prometheus/rules/<area>.yml,
grafana/dashboards/*.json (needs the `mixin` extra), alertmanager/alertmanager.yml and, with
--kubernetes, kubernetes/prometheusrule.yaml and kubernetes/grafana-dashboards.yaml.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from rankscope.mixin import _yaml, alertmanager, kubernetes, rules
from rankscope.mixin.config import Tunables, apply_overrides

PROG = "rankscope-mixin"
RULES_DIR = Path("prometheus") / "rules"
DASHBOARDS_DIR = Path("grafana") / "dashboards"
ALERTMANAGER_DIR = Path("alertmanager")
KUBERNETES_DIR = Path("kubernetes")


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


def _obsolete(out: Path, written: dict[Path, str]) -> list[Path]:
    """Generated rule files under `out` that the rule areas no longer produce (a renamed or removed area)."""
    return [
        path
        for path in sorted((out / RULES_DIR).glob("*.yml"))
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
    args = parser.parse_args(argv)
    try:
        tunables = apply_overrides(Tunables(), args.overrides)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.print_tunables:
        for name, value in asdict(tunables).items():
            print(f"{name}={value}")
        return 0
    try:
        files = outputs(tunables, with_kubernetes=args.kubernetes)
    except MissingExtra as exc:
        if args.check:  # the committed dashboards cannot be checked without the SDK
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        print(f"{PROG}: {exc}; writing the rules and routes only", file=sys.stderr)
        files = outputs(tunables, with_kubernetes=args.kubernetes, with_dashboards=False)
    if args.check:
        stale = [str(args.out / p) for p, text in files.items() if not _same(args.out / p, text)]
        stale += [f"{p} (no area generates it)" for p in _obsolete(args.out, files)]
        if stale:
            print(f"{PROG}: stale files (run {PROG}): {', '.join(stale)}", file=sys.stderr)
            return 1
        return 0
    for path in _obsolete(args.out, files):
        path.unlink()
    for relative, text in files.items():
        path = args.out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not _same(path, text):
            path.write_text(text)
    return 0


def _same(path: Path, text: str) -> bool:
    return path.is_file() and path.read_text() == text


if __name__ == "__main__":
    sys.exit(main())
