"""The trainer's run log (one JSON record a line), as the campaign's runner and operator read it mid-run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_records"]


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every complete record so far (a line still being written is left for the next read)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
