"""Every rank's Python stacks, taken while it is hung, gathered without a collective, and folded.

A hung rank's training thread is blocked (in an all-reduce, a DataLoader queue, a read), but its
serving threads are not: `capture()` runs on one of them and reads every other thread's frames with
`sys._current_frames()`. Rank 0 gathers the other ranks' stacks over HTTP (`gather`): a collective
would wait behind the very one that hangs. `fold` groups ranks whose stacks are identical, so 4096
ranks read as a few lines ("ranks 0-4094: all_reduce in distributed_c10d.py:...; rank 4095: get in
queues.py:...").

Why not torch.distributed.debug (torch 2.14): its server answers stacks without authentication and
needs aiohttp; its Flight Recorder dumps add nothing on gloo that `rankscope_collectives_total`
does not already show per rank. Taking the stacks is ten lines of standard library; serving them
behind the control token is what matters (docs/hangs.md).

No torch here: `rankscope-ctl stacks` imports it.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.control.client import ClientTls

__all__ = ["Folded", "capture", "fold", "format_ranks", "gather", "headline", "render", "write_stacks"]

#: Seconds one rank gets to answer a stacks request (a hung rank's serving threads still answer).
GATHER_TIMEOUT = 5.0
#: Requests in flight at once while gathering (4096 ranks at 5 s each would otherwise take hours).
GATHER_PARALLEL = 32
#: The standard library's waiting plumbing (threading, queue, selectors, multiprocessing) says where a
#: thread waits, not why: the headline names the innermost frame outside it.
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _plumbing(path: str) -> bool:
    return path.startswith(_STDLIB) and "site-packages" not in path


def capture() -> list[dict[str, Any]]:
    """This process's threads and their stacks (outermost frame first), the calling thread left out.

    The main thread comes first; the others by name."""
    names = {thread.ident: thread for thread in threading.enumerate()}
    me = threading.get_ident()
    main = threading.main_thread().ident
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue  # the serving thread answering this request: the same on every rank, and no news
        thread = names.get(ident)
        frames = [
            {"file": entry.filename, "line": entry.lineno or 0, "function": entry.name, "code": entry.line or ""}
            for entry in traceback.extract_stack(frame)
        ]
        threads.append(
            {
                "thread": thread.name if thread is not None else f"thread-{ident}",
                "main": ident == main,
                "daemon": bool(thread.daemon) if thread is not None else True,
                "frames": frames,
            }
        )
    threads.sort(key=lambda t: (not t["main"], t["thread"]))
    return threads


#: What a rank has in flight, read when its stacks are taken (`Monitor.collective_in_flight`).
InFlightReader = Callable[[], "dict[str, Any] | None"]


def own_stacks(rank: int, in_flight: InFlightReader | None = None) -> dict[str, Any]:
    """This rank's answer to a stacks request, with the oldest collective it has in flight, if any."""
    answer: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "time": time.time(), "threads": capture()}
    if in_flight is not None:
        try:
            collective = in_flight()
        except Exception as exc:  # the stacks matter more than the collective: hand them over regardless
            answer["collective_error"] = repr(exc)
        else:
            if collective is not None:
                answer["collective"] = collective
    return answer


def headline(threads: list[dict[str, Any]], collective: dict[str, Any] | None = None) -> str:
    """Where the main thread is: its innermost frame outside the standard library's waiting
    plumbing ("all_reduce in distributed_c10d.py:2950"), or "no main thread"; preceded by the
    collective in flight, if any ("in all_reduce (data): _engine_run_backward in graph.py:829"): a
    wait inside C++, as DDP's all-reduce under backward, shows in Python only as the call that entered it."""
    main = next((t for t in threads if t.get("main")), None)
    if main is None or not main.get("frames"):
        where = "no main thread"
    else:
        frames = main["frames"]
        chosen = next((f for f in reversed(frames) if not _plumbing(f["file"])), frames[-1])
        where = f"{chosen['function']} in {Path(chosen['file']).name}:{chosen['line']}"
    if collective is None:
        return where
    return f"in {collective['kind']} ({collective['dim']}): {where}"


def _stack_text(threads: list[dict[str, Any]], collective: dict[str, Any] | None = None) -> str:
    """The stacks as text: what two ranks must share to fold together (the collective's kind, dim and
    group included, its start time not: ranks in one collective fold together)."""
    lines = []
    if collective is not None:
        lines.append(f"In flight: {collective['kind']} ({collective['dim']}, group {collective['group']})")
    for thread in threads:
        lines.append(f'Thread "{thread["thread"]}"{" (main)" if thread.get("main") else ""}:')
        for frame in thread["frames"]:
            lines.append(f'  File "{frame["file"]}", line {frame["line"]}, in {frame["function"]}')
            if frame.get("code"):
                lines.append(f"    {frame['code']}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Folded:
    """Ranks whose stacks are identical."""

    ranks: tuple[int, ...]
    headline: str
    text: str


def fold(by_rank: Mapping[int, dict[str, Any]]) -> list[Folded]:
    """Group ranks with identical stacks (or identical errors), the largest group first."""
    groups: dict[str, list[int]] = {}
    heads: dict[str, str] = {}
    for rank in sorted(by_rank):
        answer = by_rank[rank]
        if "error" in answer:
            text, head = f"no stacks: {answer['error']}", f"no stacks ({answer['error']})"
        else:
            collective = answer.get("collective")
            text, head = _stack_text(answer["threads"], collective), headline(answer["threads"], collective)
        groups.setdefault(text, []).append(rank)
        heads[text] = head
    folded = [Folded(tuple(ranks), heads[text], text) for text, ranks in groups.items()]
    return sorted(folded, key=lambda f: (-len(f.ranks), f.ranks[0]))


def format_ranks(ranks: Iterable[int]) -> str:
    """ "rank 3", "ranks 0-4094", "ranks 0-2, 5, 7-9"."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    start: int | None = None
    previous: int | None = None
    for rank in [*ordered, None]:
        if start is not None and previous is not None and (rank is None or rank != previous + 1):
            spans.append(str(start) if start == previous else f"{start}-{previous}")
            start = None
        if rank is not None and start is None:
            start = rank
        previous = rank
    word = "rank" if len(ordered) == 1 else "ranks"
    return f"{word} {', '.join(spans)}"


def render(folded: list[Folded], full: bool = True) -> str:
    """The summary line ("ranks 0-4094: ...; rank 4095: ..."), then each group's stacks when `full`."""
    summary = "; ".join(f"{format_ranks(group.ranks)}: {group.headline}" for group in folded)
    if not full:
        return summary
    parts = [summary]
    for group in folded:
        parts.append(f"\n=== {format_ranks(group.ranks)} ===\n{group.text}")
    return "\n".join(parts) + "\n"


def _fetch(url: str, token: str | None, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        # Over TLS, rank 0 trusts and presents what the operator's tools do (RANKSCOPE_CONTROL_CA/_CERT/_KEY).
        context = ClientTls.from_env().ssl_context() if url.startswith("https:") else None
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        return {"error": f"HTTP {exc.code} from {url}"}
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return {"error": f"{url}: {reason}"}


def gather(peers: Mapping[int, str], token: str | None, timeout: float = GATHER_TIMEOUT) -> dict[int, dict[str, Any]]:
    """Each peer's stacks, by rank: `peers` maps a rank to the base URL of its endpoint. A rank that
    does not answer in `timeout` seconds gets {"error": ...} instead (it is named, never dropped)."""
    if not peers:
        return {}
    with ThreadPoolExecutor(
        max_workers=min(GATHER_PARALLEL, len(peers)), thread_name_prefix="rankscope-stacks"
    ) as pool:
        answers = {rank: pool.submit(_fetch, f"{url}/v1/stacks?local=1", token, timeout) for rank, url in peers.items()}
        return {rank: future.result() for rank, future in answers.items()}


def write_stacks(
    directory: str | os.PathLike[str], by_rank: Mapping[int, dict[str, Any]], label: str, header: str = ""
) -> Path:
    """Write the folded text (`rankscope-stacks-<label>.txt`, after `header` if one is given) and every
    rank's raw answer (`.json`) into `directory`; returns the text file's path. Written whole or not at all
    (a temporary file renamed), so a restart that follows never leaves half a file."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    text_path = folder / f"rankscope-stacks-{label}.txt"
    for path, content in (
        (folder / f"rankscope-stacks-{label}.json", json.dumps({str(r): a for r, a in sorted(by_rank.items())})),
        (text_path, (f"{header}\n\n" if header else "") + render(fold(by_rank))),
    ):
        partial = path.with_name(path.name + ".partial")
        partial.write_text(content, encoding="utf-8")
        os.replace(partial, path)
    return text_path
