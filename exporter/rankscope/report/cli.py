"""rankscope-report: one self-contained HTML report (and a PNG summary) of a training run.

    rankscope-report --prometheus http://127.0.0.1:9090 --out report.html
    rankscope-report --prometheus http://prom:9090 --run-id my-run --log runs/demo/log.jsonl --out report.html

Without --run-id the report is about the run with the newest samples. --log adds
the trainer's JSONL run log (every step's loss, exact checkpoint and stop
records) and the attention maps saved beside it. --campaign adds a fault
campaign's table (python -m benchmarks.campaign --json) as a section. Works on a live run (run it
again for a newer picture) and on a finished one, as long as Prometheus keeps it.
Exit status: 0 written, 1 a problem named in one line (Prometheus unreachable,
unknown run, no data yet, unreadable log or campaign), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from rankscope.report.errors import ReportError

__all__ = ["main"]

PROG = "rankscope-report"
DEFAULT_PROMETHEUS = "http://127.0.0.1:9090"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line."""

    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: {message} (see {PROG} --help)", file=sys.stderr)
        raise SystemExit(2)


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a price (a number), got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0], epilog="See docs/report.md.")
    parser.add_argument(
        "--prometheus",
        default=os.environ.get("RANKSCOPE_PROMETHEUS_URL", DEFAULT_PROMETHEUS),
        metavar="URL",
        help="Prometheus (or compatible) HTTP API holding the run "
        f"(default: $RANKSCOPE_PROMETHEUS_URL, else {DEFAULT_PROMETHEUS})",
    )
    parser.add_argument("--run-id", default=None, help="the run's run_id label (default: the newest run)")
    parser.add_argument("--log", type=Path, default=None, metavar="RUN_LOG.jsonl", help="the trainer's run log")
    parser.add_argument(
        "--attention", type=Path, default=None, metavar="DIR",
        help="attention maps saved by the trainer (default: attention/ beside --log)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path("report.html"),
        help="HTML file to write (default: %(default)s); the PNG summary goes beside it",
    )  # fmt: skip
    parser.add_argument("--timeout", type=_positive, default=30.0, help="seconds per Prometheus request")
    parser.add_argument(
        "--price-per-gpu-hour", type=_price, default=None, metavar="PRICE",
        help="show the goodput section's GPU-hours in money too (any currency)",
    )  # fmt: skip
    parser.add_argument(
        "--campaign", type=Path, default=None, metavar="CAMPAIGN.json",
        help="add the fault campaign's table (the file `python -m benchmarks.campaign --json` wrote)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out.suffix.lower() not in (".html", ".htm"):
        print(f"{PROG}: --out must name an .html file, got {args.out}", file=sys.stderr)
        return 2
    try:
        from rankscope.report.build import ReportRequest, build_report  # matplotlib: only once the arguments are good
    except ImportError as exc:
        print(f"{PROG}: {exc.name or 'a plotting library'} is not installed: pip install 'rankscope[report]'",
              file=sys.stderr)  # fmt: skip
        return 1
    request = ReportRequest(
        args.prometheus, args.out, args.run_id, args.log, args.attention, args.timeout, args.price_per_gpu_hour,
        campaign=args.campaign,
    )  # fmt: skip
    try:
        report = build_report(request)
    except ReportError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing written", file=sys.stderr)
        return 130
    size = report.html.stat().st_size / 1e6
    print(
        f"wrote {report.html} ({size:.1f} MB, {report.images} images) and {report.png}: run {report.run_id}, "
        f"{report.alerts} alert(s) fired, {report.actions} action(s) applied"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
