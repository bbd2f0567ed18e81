"""rankscope.report stays apart: `import exporter` loads neither it nor matplotlib, and it is installable."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from tests.support import REPO


def _modules_after(code: str) -> set[str]:
    listing = subprocess.run([sys.executable, "-c", f"{code}; import sys; print(' '.join(sys.modules))"],
                             cwd=REPO, capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    return set(listing.stdout.split())


def test_import_exporter_loads_neither_the_report_nor_matplotlib() -> None:
    loaded = _modules_after("import exporter, rankscope.control")
    assert not {m for m in loaded if m.startswith(("rankscope.report", "matplotlib"))}


def test_the_prometheus_client_and_the_command_line_load_matplotlib_only_to_draw() -> None:
    loaded = _modules_after("import rankscope.report.cli, rankscope.report.run, rankscope.report.runlog")
    assert "matplotlib" not in loaded


def test_the_command_and_its_extra_are_declared() -> None:
    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    assert scripts["rankscope-report"] == "rankscope.report.cli:main"
    requires = metadata.requires("rankscope") or []
    assert any(r.startswith("matplotlib") and 'extra == "report"' in r for r in requires), requires
    # CI installs the dev extra: it has matplotlib, directly or through rankscope[...,report].
    dev = [r for r in requires if 'extra == "dev"' in r]
    assert any(r.startswith("matplotlib") or (r.startswith("rankscope[") and "report" in r) for r in dev), dev
