"""Many simulated ranks in one process: each port serves a realistic rankscope page.

    python -m benchmarks.fakeranks --template page.txt --ranks 256 --base-port 20000

`--template` is one real rank's /metrics page (benchmarks.scale captures it
from the exporter after training the reference model). Rank r is served on
base_port + r with the same series, relabelled as rank r of one large run
(`local_rank` r % ranks_per_node, `node` sim-node-<r // ranks_per_node>), and
values that move like a live run's: counters and histograms grow at the rate
the template implies (its value spread over `--age` seconds of training, so
rate() and histogram_quantile() give the template's numbers), gauges wobble a
few percent, each rank a little slower or faster than the others. Nothing is
computed per series beyond one multiplication, so hundreds of ranks cost the
Prometheus under test far more than they cost this process.

One asyncio loop serves every port (HTTP/1.1 keep-alive, as Prometheus
scrapes). Prints `ready` when all ports listen; stops on SIGTERM/SIGINT.
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

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["RankPage", "main", "parse_template"]

IDENTITY = ("run_id", "rank", "local_rank", "node")
#: Sample kinds that only grow (scaled with time) and ones that hold still.
_GROWING_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


@dataclass(frozen=True)
class Series:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    kind: str
    """grow (counter-like), wobble (gauge), now (a Unix timestamp: the time of the scrape) or still."""


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


def _kind(family_type: str, name: str) -> str:
    if name.endswith("_timestamp_seconds"):
        return "now"  # e.g. the last step's time: a live rank says "just now"
    if name.endswith(("_created", "_info")) or family_type == "info":
        return "still"
    if family_type in ("counter", "histogram", "summary") and name.endswith(_GROWING_SUFFIXES):
        return "grow"
    return "grow" if name.endswith("global_step") else "wobble"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class RankPage:
    """One simulated rank: its page's fixed text parts and how each value moves."""

    def __init__(self, families: list[Family], rank: int, ranks_per_node: int, run_id: str, age: float) -> None:
        identity = {"run_id": run_id, "rank": str(rank), "local_rank": str(rank % ranks_per_node),
                    "node": f"sim-node-{rank // ranks_per_node}"}  # fmt: skip
        rng = random.Random(rank)
        self.speed = rng.uniform(0.95, 1.05)  # each rank a little faster or slower
        self.phase = rng.uniform(0, 2 * math.pi)
        self.age = age
        self.started = time.time()
        self.parts: list[tuple[str, float, str]] = []  # (text before the value, base value, kind)
        for family in families:
            header = family.header
            for series in family.series:
                labels = {key: identity.get(key, value) for key, value in series.labels}
                text = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
                self.parts.append((f"{header}{series.name}{{{text}}} ", series.value, series.kind))
                header = ""

    def render(self, now: float) -> bytes:
        grow = self.speed * (1.0 + (now - self.started) / self.age)
        wobble = 1.0 + 0.03 * math.sin(now / 7.0 + self.phase)
        out = []
        for prefix, value, kind in self.parts:
            if kind == "grow":
                value *= grow
            elif kind == "wobble":
                value *= wobble * self.speed
            elif kind == "now":
                value = now
            out.append(f"{prefix}{value!r}\n")
        return "".join(out).encode()


async def _serve_connection(page: RankPage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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


async def _main(pages: list[RankPage], host: str, base_port: int) -> None:
    servers = []
    for rank, page in enumerate(pages):
        handler = lambda r, w, p=page: _serve_connection(p, r, w)  # noqa: E731 - binds this rank's page
        servers.append(await asyncio.start_server(handler, host, base_port + rank))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fakeranks", description=__doc__.splitlines()[0])
    parser.add_argument("--template", type=Path, required=True, help="a real rank's /metrics page")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--base-port", type=int, required=True, help="rank r listens on base-port + r")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--run-id", default="scale-sim")
    parser.add_argument("--age", type=float, default=600.0, help="seconds of training the template's counters hold")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.ranks_per_node < 1 or args.age <= 0:
        parser.error("--ranks and --ranks-per-node must be >= 1 and --age > 0")
    if not 1 <= args.base_port <= 65535 - args.ranks:
        parser.error(f"--base-port {args.base_port} leaves no room for {args.ranks} ports")
    try:
        families = parse_template(args.template.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--template {args.template}: {exc}")
    pages = [RankPage(families, rank, args.ranks_per_node, args.run_id, args.age) for rank in range(args.ranks)]
    asyncio.run(_main(pages, args.host, args.base_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
