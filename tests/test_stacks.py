"""Stacks on demand (issue 26): a hung process's stacks over real HTTP, behind the control token, folded.

A real child process blocks its main thread in a queue (as a DataLoader deadlock does) while its peer
endpoint, served from the process's own threads, answers; no mocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest
from rankscope.control import stacks
from rankscope.control.app import AppDeps, create_app
from rankscope.control.restart import RESTART_EXIT_STATUS
from rankscope.control.state import ActionQueue, RunSnapshot

TOKEN = "s3cret-token"

HUNG_CHILD = textwrap.dedent(
    """
    import queue, sys
    from rankscope.control.endpoint import serve_control
    from rankscope.control.peer import create_peer_app

    server = serve_control(create_peer_app(3, sys.argv[1]), "127.0.0.1", 0)
    print(server.url, flush=True)

    def wait_for_batch():
        queue.Queue().get()  # never arrives: the training thread is hung here

    wait_for_batch()
    """
)


@pytest.fixture
def hung_peer():
    child = subprocess.Popen(
        [sys.executable, "-c", HUNG_CHILD, TOKEN], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        url = child.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield child, url
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def _get(url: str, token: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_hung_rank_hands_over_every_threads_stack_with_the_blocking_frame(hung_peer):
    _, url = hung_peer
    gathered = stacks.gather({3: url}, TOKEN)
    answer = gathered[3]
    assert answer["rank"] == 3
    main = next(t for t in answer["threads"] if t["main"])
    assert [f["function"] for f in main["frames"]][:2] == ["<module>", "wait_for_batch"]
    assert main["frames"][-1]["file"].endswith("threading.py")  # where it waits: inside queue.get
    assert any(not t["main"] for t in answer["threads"])  # the serving threads too (all threads)
    # The headline skips the standard library's waiting plumbing and names the loop's own frame.
    assert stacks.headline(answer["threads"]).startswith("wait_for_batch in <string>:")


@pytest.mark.parametrize(("token", "status"), [(None, 401), ("wrong", 403), ("", 401)])
def test_stacks_without_the_token_are_refused_and_reveal_nothing(hung_peer, token, status):
    _, url = hung_peer
    got, body = _get(f"{url}/v1/stacks", token)
    assert got == status
    text = body.decode()
    assert "frames" not in text and "wait_for_batch" not in text and "rank" not in json.loads(text)


def test_the_exit_request_ends_the_hung_process_with_the_documented_status(hung_peer):
    child, url = hung_peer
    request = urllib.request.Request(f"{url}/v1/exit", data=b"{}", method="POST")
    request.add_header("Authorization", f"Bearer {TOKEN}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 202
    assert child.wait(10) == RESTART_EXIT_STATUS


def test_the_exit_request_needs_the_token(hung_peer):
    child, url = hung_peer
    request = urllib.request.Request(f"{url}/v1/exit", data=b"{}", method="POST")
    request.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401
    assert child.poll() is None


def test_4096_ranks_fold_into_one_line_per_distinct_stack():
    def answer(function: str, file: str) -> dict:
        frames = [{"file": "/job/train.py", "line": 10, "function": "main", "code": ""},
                  {"file": file, "line": 42, "function": function, "code": ""}]  # fmt: skip
        return {"threads": [{"thread": "MainThread", "main": True, "daemon": False, "frames": frames}]}

    by_rank = {rank: answer("all_reduce", "/torch/distributed_c10d.py") for rank in range(4095)}
    by_rank[4095] = answer("get", "/job/loader.py")
    folded = stacks.fold(by_rank)
    assert [f.ranks for f in folded] == [tuple(range(4095)), (4095,)]
    assert stacks.render(folded, full=False) == (
        "ranks 0-4094: all_reduce in distributed_c10d.py:42; rank 4095: get in loader.py:42"
    )


def test_a_rank_that_does_not_answer_is_named_not_dropped():
    gathered = stacks.gather({1: "http://127.0.0.1:9"}, TOKEN, timeout=2)  # discard port: refused
    assert "error" in gathered[1]
    assert stacks.render(stacks.fold(gathered), full=False).startswith("rank 1: no stacks (")


def test_format_ranks():
    assert stacks.format_ranks([5]) == "rank 5"
    assert stacks.format_ranks([0, 1, 2, 5, 7, 8, 9]) == "ranks 0-2, 5, 7-9"


def test_written_stacks_are_whole_files_beside_the_checkpoints(tmp_path):
    by_rank = {0: stacks.own_stacks(0), 1: {"error": "timed out"}}
    path = stacks.write_stacks(tmp_path, by_rank, "restart-1")
    assert path.read_text().startswith(("rank 0: ", "rank 1: "))
    assert json.loads((tmp_path / "rankscope-stacks-restart-1.json").read_text())["1"] == {"error": "timed out"}
    assert not list(tmp_path.glob("*.partial"))


def test_rank_0s_stacks_route_needs_the_token(wsgi_call):
    app = create_app(AppDeps(ActionQueue(), RunSnapshot(), TOKEN, stacks=lambda local: {"summary": "", "groups": []}))
    assert wsgi_call(app, "GET", "/v1/stacks", headers={})[0] == 401
    assert wsgi_call(app, "GET", "/v1/stacks", headers={"Authorization": "Bearer nope"})[0] == 403
    assert wsgi_call(app, "GET", "/v1/stacks", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200


def test_ranks_in_the_same_collective_fold_together_and_the_headline_names_it():
    def answer(function: str, file: str, collective: dict | None) -> dict:
        frames = [{"file": "/job/train.py", "line": 10, "function": "main", "code": ""},
                  {"file": file, "line": 42, "function": function, "code": ""}]  # fmt: skip
        found = {"threads": [{"thread": "MainThread", "main": True, "daemon": False, "frames": frames}]}
        return {**found, "collective": collective} if collective else found

    def reduce(since: float) -> dict:
        return {"kind": "all_reduce", "dim": "data", "group": "0", "since": since}

    # DDP's all-reduce runs under backward: the Python stack shows only the call that entered C++.
    by_rank = {rank: answer("_engine_run_backward", "/torch/graph.py", reduce(100.0 + rank)) for rank in range(3)}
    by_rank[3] = answer("get", "/job/loader.py", None)
    by_rank[4] = answer("_engine_run_backward", "/torch/graph.py", {**reduce(1.0), "kind": "all_gather"})
    assert stacks.render(stacks.fold(by_rank), full=False) == (
        "ranks 0-2: in all_reduce (data): _engine_run_backward in graph.py:42; rank 3: get in loader.py:42; "
        "rank 4: in all_gather (data): _engine_run_backward in graph.py:42"
    )


def test_stacks_are_handed_over_even_when_the_collective_cannot_be_read():
    def broken() -> dict:
        raise RuntimeError("flight recorder gone")

    answer = stacks.own_stacks(0, broken)
    assert "threads" in answer and "collective" not in answer
    assert "flight recorder gone" in answer["collective_error"]
