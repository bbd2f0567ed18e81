"""Many simulated ranks in one process, several ranks per page, each rank a realistic rankscope page.

    python -m benchmarks.fakeranks --template page.txt --ranks 4096 --ranks-per-page 64 --base-port 20000

`--template` is one real rank's /metrics page (benchmarks.scale captures it
from the exporter after training the reference model). Rank r has the same
series, relabelled as rank r of one large run (`local_rank` r % ranks_per_node,
`node` sim-node-<r // ranks_per_node>), and values that move like a live
run's: counters and histograms grow at the rate the template implies (its
value spread over `--age` seconds of training, so rate() and
histogram_quantile() give the template's numbers), gauges wobble a few
percent, each rank a little slower or faster than the others.

Ranks are served `--ranks-per-page` to a page: page p on base_port + p holds
ranks p*K .. p*K+K-1, each series with its own identity labels, so a scrape
job with `honor_labels: true` (as shipped) stores exactly the series N
separate ranks would produce. Why pages of several ranks rather than one port
per rank: the number under test is what Prometheus (or VictoriaMetrics) pays
per stored series and per rule evaluation, and on a 2-core machine thousands
of ports would have the simulator's per-request work (and thousands of
sockets on both sides) compete with it; 16,384 ranks also need more
consecutive free ports than a machine has to spare. What pages of K ranks
leave out is each target's own series (`up`, `scrape_duration_seconds`, ...:
5 per target instead of per rank) and per-target scrape overhead; the
benchmark says so where it prints memory per rank.

Rendering a page is one multiplication and one float formatting per sample
(no parsing, no label building), so 4096 ranks at a 5 s scrape cost this
process a few percent of a core. One asyncio loop serves every port
(HTTP/1.1 keep-alive, as Prometheus and vmagent scrape). Prints `ready` when
all ports listen; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Page", "RankSeries", "main", "parse_template"]

IDENTITY = ("run_id", "rank", "local_rank", "node")
#: Sample kinds that only grow (scaled with time) and ones that hold still.
_GROWING_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
#: How each kind of value moves: which of Page.render's per-rank factor tables it is multiplied by.
_GROW, _WOBBLE, _STILL, _NOW = range(4)


@dataclass(frozen=True)
class Series:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    kind: int
    """_GROW (counter-like), _WOBBLE (gauge), _NOW (a Unix timestamp: the time of the scrape) or _STILL."""


@dataclass(frozen=True)
class Family:
    header: str
    """# HELP and # TYPE lines."""
    series: tuple[Series, ...]


def parse_template(text: str) -> list[Family]:
    """The template page's families and samples, classified by how their values move."""
    families = []
    for family in text_string_to_metric_families(text):
        kind_name = family.type
        exposed = family.name + ("_total" if kind_name == "counter" else "")
        help_text = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        header = f"# HELP {exposed} {help_text}\n# TYPE {exposed} {_text_type(kind_name)}\n"
        samples = tuple(
            Series(s.name, tuple(s.labels.items()), float(s.value), _kind(kind_name, s.name)) for s in family.samples
        )
        families.append(Family(header, samples))
    return families


def _text_type(kind: str) -> str:
    # The text format knows these five; the parser reports an Info family as "info" (a gauge of 1).
    return kind if kind in ("counter", "gauge", "histogram", "summary") else "gauge"


def _kind(family_type: str, name: str) -> int:
    if name.endswith("_timestamp_seconds"):
        return _NOW  # e.g. the last step's time: a live rank says "just now"
    if name.endswith(("_created", "_info")) or family_type == "info":
        return _STILL
    if family_type in ("counter", "histogram", "summary") and name.endswith(_GROWING_SUFFIXES):
        return _GROW
    return _GROW if name.endswith("global_step") else _WOBBLE


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class RankSeries:
    """One simulated rank: the text of each of its sample lines up to the value, and how its values move."""

    def __init__(self, families: list[Family], rank: int, ranks_per_node: int, run_id: str, age: float) -> None:
        identity = {"run_id": run_id, "rank": str(rank), "local_rank": str(rank % ranks_per_node),
                    "node": f"sim-node-{rank // ranks_per_node}"}  # fmt: skip
        rng = random.Random(rank)
        self.speed = rng.uniform(0.95, 1.05)  # each rank a little faster or slower
        self.phase = rng.uniform(0, 2 * math.pi)
        #: Per family: (line up to the value, base value, kind) of each sample.
        self.lines: list[list[tuple[str, float, int]]] = []
        for family in families:
            lines = []
            for series in family.series:
                labels = {key: identity.get(key, value) for key, value in series.labels}
                text = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
                base = 1.0 if series.kind == _NOW else series.value
                lines.append((f"{series.name}{{{text}}} ", base, series.kind))
            self.lines.append(lines)


class Page:
    """The ranks served on one port, rendered family by family (every rank's samples under one header)."""

    def __init__(self, families: list[Family], ranks: list[RankSeries], age: float) -> None:
        self.ranks = ranks
        self.age = age
        self.started = time.time()
        self.speed = np.array([rank.speed for rank in ranks])
        self.phase = np.array([rank.phase for rank in ranks])
        # In page order, one entry per sample line: the text before the value (a family's HELP/TYPE lines go
        # before its first sample), its format, its base value and where its factor is in the per-render table
        # (kind * len(ranks) + the rank's position). Counts that are whole numbers in the template (buckets,
        # steps, samples) stay whole: real counts are, and formatting an integer is ~4x cheaper.
        prefixes, formats, bases, slots = [], [], [], []
        for index, family in enumerate(families):
            header = family.header
            for position, rank in enumerate(ranks):
                for prefix, base, kind in rank.lines[index]:
                    prefixes.append(header + prefix)
                    formats.append("%d\n" if kind == _GROW and base.is_integer() else "%r\n")
                    bases.append(base)
                    slots.append(kind * len(ranks) + position)
                    header = ""
        self.prefixes, self.formats = prefixes, formats
        self.bases, self.slots = np.array(bases), np.array(slots)

    def render(self, now: float) -> bytes:
        grow = self.speed * (1.0 + (now - self.started) / self.age)
        wobble = self.speed * (1.0 + 0.03 * np.sin(now / 7.0 + self.phase))
        table = np.concatenate([grow, wobble, np.ones(len(self.ranks)), np.full(len(self.ranks), now)])
        values = (self.bases * table[self.slots]).tolist()  # one multiplication per sample, vectorised
        return "".join(map(str.__add__, self.prefixes, map(str.__mod__, self.formats, values))).encode()


async def _serve_connection(page: Page, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            request = await reader.readuntil(b"\r\n\r\n")
            if not request.startswith(b"GET "):
                break
            body = page.render(time.time())
            head = (
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def _main(pages: list[Page], host: str, base_port: int) -> None:
    servers = []
    for index, page in enumerate(pages):
        handler = lambda r, w, p=page: _serve_connection(p, r, w)  # noqa: E731 - binds this port's page
        servers.append(await asyncio.start_server(handler, host, base_port + index))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def pages_needed(ranks: int, ranks_per_page: int) -> int:
    """How many ports `ranks` simulated ranks take at `ranks_per_page` per page."""
    return -(-ranks // ranks_per_page)


def build_pages(families: list[Family], ranks: int, ranks_per_page: int, ranks_per_node: int, run_id: str,
                age: float) -> list[Page]:  # fmt: skip
    """The pages serving ranks 0..ranks-1, `ranks_per_page` to a page (the last one may hold fewer)."""
    simulated = [RankSeries(families, rank, ranks_per_node, run_id, age) for rank in range(ranks)]
    return [Page(families, simulated[first : first + ranks_per_page], age) for first in range(0, ranks, ranks_per_page)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fakeranks", description=__doc__.splitlines()[0])
    parser.add_argument("--template", type=Path, required=True, help="a real rank's /metrics page")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--ranks-per-page", type=int, default=1, help="ranks served on each port (honor_labels)")
    parser.add_argument("--base-port", type=int, required=True, help="page p listens on base-port + p")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--run-id", default="scale-sim")
    parser.add_argument("--age", type=float, default=600.0, help="seconds of training the template's counters hold")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.ranks_per_page < 1 or args.ranks_per_node < 1 or args.age <= 0:
        parser.error("--ranks, --ranks-per-page and --ranks-per-node must be >= 1 and --age > 0")
    count = pages_needed(args.ranks, args.ranks_per_page)
    if not 1 <= args.base_port <= 65535 - count:
        parser.error(f"--base-port {args.base_port} leaves no room for {count} ports")
    try:
        families = parse_template(args.template.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--template {args.template}: {exc}")
    pages = build_pages(families, args.ranks, args.ranks_per_page, args.ranks_per_node, args.run_id, args.age)
    asyncio.run(_main(pages, args.host, args.base_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
