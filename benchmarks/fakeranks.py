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

The pages are not all alike (`--scenarios`, on by default), so that the rules are measured on a run
with something to find rather than tuned to identical pages. The ranks form one large run with:

- a straggler: rank 1 computes twice as long per step as the others (`compute_duration_seconds`);
- a down rank: the third-last page stops answering `--down-after` seconds after the start (its scrapes
  fail, so Prometheus marks its ranks' series stale and `up` 0);

and, on the last two pages, two small runs of their own:

- a hung run (`<run-id>-hung`): from `--hang-after` seconds its steps, counters and step timestamps
  stop; its rank 1 waits for data (phase data_wait) while the others wait in a collective, having
  started one more than it;
- a paused run (`<run-id>-paused`): paused (phase paused, `rankscope_paused` 1) from the start.

Everywhere else the ranks are in compute or in a collective, about half each at any scrape, with
equal collective counts, as ranks sampled at random moments of a DDP step would be. Series a job
keeps once (the goodput buckets, the control actions, the steps lost to restarts) are served by
each run's rank 0 only, as the exporter does.

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
#: Families a job serves once, from its rank 0 (rankscope.contract: the goodput ledger, the control channel).
RANK0_ONLY = (
    "rankscope_goodput_seconds_total",
    "rankscope_control_actions_total",
    "rankscope_control_last_applied_timestamp_seconds",
    "rankscope_restart_lost_steps_total",
)
#: Sample names whose values a scenario sets rank by rank (Page.render's per-name tables).
PHASE, PAUSED, COLLECTIVES, COMPUTE = (
    "rankscope_phase", "rankscope_paused", "rankscope_collectives_total", "rankscope_compute_duration_seconds_sum",
)  # fmt: skip
_STATEFUL = (PHASE, PAUSED, COLLECTIVES, COMPUTE)
_COMPUTE_PHASE, _DATA_WAIT_PHASE, _COLLECTIVE_PHASE, _PAUSED_PHASE = 3, 2, 4, 7
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


@dataclass(frozen=True)
class Role:
    """What one simulated rank is in the scenario: its run, its rank in that run, and what happens to it."""

    run_id: str
    rank: int
    node: str
    local_rank: int
    straggler: bool = False
    hung: bool = False
    waits_for_data: bool = False
    paused: bool = False


class RankSeries:
    """One simulated rank: the text of each of its sample lines up to the value, and how its values move."""

    def __init__(self, families: list[Family], role: Role, seed: int) -> None:
        identity = {"run_id": role.run_id, "rank": str(role.rank), "local_rank": str(role.local_rank),
                    "node": role.node}  # fmt: skip
        self.role = role
        rng = random.Random(seed)
        self.speed = rng.uniform(0.95, 1.05)  # each rank a little faster or slower
        self.phase = rng.uniform(0, 2 * math.pi)
        #: Per family: (line up to the value, base value, kind, sample name) of each sample.
        self.lines: list[list[tuple[str, float, int, str]]] = []
        for family in families:
            lines = []
            for series in family.series:
                if role.rank != 0 and series.name in RANK0_ONLY:
                    continue
                labels = {key: identity.get(key, value) for key, value in series.labels}
                text = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
                base = 1.0 if series.kind == _NOW or series.name in (PHASE, PAUSED) else series.value
                lines.append((f"{series.name}{{{text}}} ", base, series.kind, series.name))
            self.lines.append(lines)


class Page:
    """The ranks served on one port, rendered family by family (every rank's samples under one header)."""

    def __init__(self, families: list[Family], ranks: list[RankSeries], age: float, hang_at: float = math.inf,
                 down_at: float = math.inf) -> None:  # fmt: skip
        self.ranks = ranks
        self.age = age
        self.started = time.time()
        self.down_at = down_at
        """Unix time from which this page answers nothing (its ranks are down)."""
        n = len(ranks)
        roles = [rank.role for rank in ranks]
        self.speed = np.array([rank.speed for rank in ranks])
        self.phase = np.array([rank.phase for rank in ranks])
        self.frozen_at = np.array([hang_at if r.hung else self.started if r.paused else math.inf for r in roles])
        self.straggler = np.array([2.0 if r.straggler else 1.0 for r in roles])
        self.waits = np.array([r.waits_for_data for r in roles])
        self.paused = np.array([r.paused for r in roles])
        self.alternate = np.array([(r.rank % 2) for r in roles])  # half the ranks in compute, half in a collective
        # In page order, one entry per sample line: the text before the value (a family's HELP/TYPE lines go
        # before its first sample), its format, its base value and where its factor is in the per-render table
        # (table * len(ranks) + the rank's position: the kinds' tables, then one per stateful sample name). Counts
        # that are whole numbers in the template (buckets, steps, samples) stay whole: real counts are, and
        # formatting an integer is ~4x cheaper.
        prefixes, formats, bases, slots = [], [], [], []
        for index, family in enumerate(families):
            header = family.header
            for position, rank in enumerate(ranks):
                for prefix, base, kind, name in rank.lines[index]:
                    table = 4 + _STATEFUL.index(name) if name in _STATEFUL else kind
                    whole = (kind == _GROW and base.is_integer()) or name in (PHASE, PAUSED)
                    prefixes.append(header + prefix)
                    formats.append("%d\n" if whole else "%r\n")
                    bases.append(base)
                    slots.append(table * n + position)
                    header = ""
        self.prefixes, self.formats = prefixes, formats
        self.bases, self.slots = np.array(bases), np.array(slots)

    def render(self, now: float) -> bytes:
        n = len(self.ranks)
        until = np.minimum(now, self.frozen_at)  # a hung or paused rank's counters and timestamps stop
        progress = 1.0 + (until - self.started) / self.age
        grow = self.speed * progress
        wobble = self.speed * (1.0 + 0.03 * np.sin(now / 7.0 + self.phase))
        flip = (self.alternate + int(now / 5.0)) % 2  # which half is in a collective changes from scrape to scrape
        phase = np.where(flip == 1, _COLLECTIVE_PHASE, _COMPUTE_PHASE)
        phase = np.where(np.isfinite(self.frozen_at) & (now >= self.frozen_at), _COLLECTIVE_PHASE, phase)
        phase = np.where(self.waits & (now >= self.frozen_at), _DATA_WAIT_PHASE, phase)
        phase = np.where(self.paused, _PAUSED_PHASE, phase)
        # Every rank of a run starts as many collectives (DDP), but the one waiting for data: one fewer.
        collectives = np.floor(progress * 100.0) / 100.0 - np.where(self.waits & (now >= self.frozen_at), 0.01, 0.0)
        table = np.concatenate([grow, wobble, np.ones(n), until, phase, self.paused.astype(float),
                                collectives, grow * self.straggler])  # fmt: skip
        values = (self.bases * table[self.slots]).tolist()  # one multiplication per sample, vectorised
        return "".join(map(str.__add__, self.prefixes, map(str.__mod__, self.formats, values))).encode()


async def _serve_connection(page: Page, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            request = await reader.readuntil(b"\r\n\r\n")
            if not request.startswith(b"GET ") or time.time() >= page.down_at:
                break  # a down rank's scrape fails
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


def roles(ranks: int, ranks_per_page: int, ranks_per_node: int, run_id: str, scenarios: bool) -> list[Role]:
    """Who each simulated rank is: one run of every rank, or (`scenarios`) the large run with a straggler, and a
    hung run and a paused run on the last two pages (when there are at least four)."""
    pages = pages_needed(ranks, ranks_per_page)
    split = scenarios and pages >= 4
    main_ranks = (pages - 2) * ranks_per_page if split else ranks
    found = []
    for index in range(ranks):
        if index < main_ranks:
            run, rank, kind = run_id, index, ""
        else:
            kind = "hung" if index < main_ranks + ranks_per_page else "paused"
            run, rank = f"{run_id}-{kind}", (index - main_ranks) % ranks_per_page
        found.append(Role(run, rank, f"{run}-node-{rank // ranks_per_node}", rank % ranks_per_node,
                          straggler=scenarios and run == run_id and rank == 1, hung=kind == "hung",
                          waits_for_data=kind == "hung" and rank == 1, paused=kind == "paused"))  # fmt: skip
    return found


def build_pages(families: list[Family], ranks: int, ranks_per_page: int, ranks_per_node: int, run_id: str,
                age: float, scenarios: bool = True, hang_after: float = 10.0,
                down_after: float = 30.0) -> list[Page]:  # fmt: skip
    """The pages serving ranks 0..ranks-1, `ranks_per_page` to a page (the last one may hold fewer)."""
    cast = roles(ranks, ranks_per_page, ranks_per_node, run_id, scenarios)
    simulated = [RankSeries(families, role, seed) for seed, role in enumerate(cast)]
    now = time.time()
    count = pages_needed(ranks, ranks_per_page)
    down_page = count - 3 if scenarios and count >= 4 else -1
    return [
        Page(families, simulated[first : first + ranks_per_page], age, hang_at=now + hang_after,
             down_at=now + down_after if page == down_page else math.inf)
        for page, first in enumerate(range(0, ranks, ranks_per_page))
    ]  # fmt: skip


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
    parser.add_argument(
        "--scenarios",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a straggler, a down page, a hung run and a paused run (see above)",
    )
    parser.add_argument("--hang-after", type=float, default=10.0, help="seconds until the hung run hangs")
    parser.add_argument("--down-after", type=float, default=30.0, help="seconds until the down page stops answering")
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
    pages = build_pages(families, args.ranks, args.ranks_per_page, args.ranks_per_node, args.run_id, args.age,
                        args.scenarios, args.hang_after, args.down_after)  # fmt: skip
    asyncio.run(_main(pages, args.host, args.base_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
