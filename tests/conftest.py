"""Shared fixtures. Helpers append fixtures here; keep each one documented."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import support

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call to get a TCP port that is free on loopback right now."""
    return support.free_port


@pytest.fixture
def free_port_block() -> Callable[[int], int]:
    """Call with n to get a base port whose n consecutive ports are free (one per rank)."""
    return support.free_port_block


# --- control endpoint (rankscope.control) ----------------------------------------------------


@pytest.fixture(scope="module")
def control_job(tmp_path_factory):
    """Call with ControlConfig settings to start tests/jobs/control_job.py on 2 ranks under torchrun
    (a tests.jobs.control_job.ControlJob); every job started is ended at the module's teardown."""
    from tests.jobs.control_job import ControlJob

    def start(control: dict | None = None, pg_timeout: float = 3.0) -> ControlJob:
        out = tmp_path_factory.mktemp("control_job")
        return ControlJob(out, support.free_port(), support.free_port(), control, pg_timeout)

    yield from support.closing_starter(start)


@pytest.fixture
def wsgi_call():
    """Call a WSGI app in-process, no socket: wsgi_call(app, method, path, body=None, headers=None)
    -> (status code, headers dict, decoded JSON body). `body` may be bytes or a JSON-able value."""
    import io
    import json

    def call(app, method: str, path: str, body=None, headers: dict | None = None):
        raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        environ = {
            "REQUEST_METHOD": method,
            "PATH_INFO": path,
            "QUERY_STRING": "",
            "SERVER_NAME": "test",
            "SERVER_PORT": "0",
            "wsgi.input": io.BytesIO(raw),
            "CONTENT_TYPE": "application/json",
        }
        if method == "POST":
            environ["CONTENT_LENGTH"] = str(len(raw))
        for name, value in (headers or {}).items():
            key = name.upper().replace("-", "_")
            if value is None:
                environ.pop(key, None)
            elif key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                environ[key] = value
            else:
                environ["HTTP_" + key] = value
        answer = {}

        def start_response(status, response_headers):
            answer["status"] = int(status.split()[0])
            answer["headers"] = dict(response_headers)

        payload = b"".join(app(environ, start_response))
        return answer["status"], answer["headers"], json.loads(payload)

    return call


# --- the reference trainer (trainer/) -------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory):
    """Call with (name, settings=[--set overrides], resume=, max_restarts=, checkpoint_dir=, config=) to start
    `torchrun -m rankscope_trainer` on 2 ranks, by default with trainer/rankscope_trainer/configs/test.yaml (a
    tests.jobs.trainer_job.TrainerJob); every job started is ended at the module's teardown."""
    from devstack.jobs import TrainerJob

    def start(name: str, settings=(), **kwargs) -> TrainerJob:
        out = tmp_path_factory.mktemp(name)
        return TrainerJob(out, support.free_port(), support.free_port_block(2), settings, **kwargs)

    yield from support.closing_starter(start)


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 1 MiB file system (tmpfs), so a checkpoint runs out of space as on a full disk."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("a 1 MiB tmpfs needs root (mount -t tmpfs) on this machine")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
