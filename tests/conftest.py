"""Shared fixtures. Helpers append fixtures here; keep each one documented."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_port_block(count: int) -> int:
    """A base port whose `count` consecutive ports are free right now."""
    for _ in range(200):
        base = _free_port()
        if base + count > 65535:
            continue
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no block of {count} free ports found")


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call to get a TCP port that is free on loopback right now."""
    return _free_port


@pytest.fixture
def free_port_block() -> Callable[[int], int]:
    """Call with n to get a base port whose n consecutive ports are free (one per rank)."""
    return _free_port_block
