"""The sharded layout raises the same alerts as one server, on the same data.

The data is every input series of the promtool unit tests (prometheus/tests/*_test.yml), written to walk each
alert across its edges. For each test group one `promtool` evaluates one server's rules (renamed) beside the
sharded layout's: the shard rules, then the global rules reading the shards' records, as one shard and a
global server federating it without delay would. At every evaluation the two sets of ``ALERTS`` (pending and
firing, every label) must be equal. What federation adds (a scrape interval per layer, series that linger
after they vanish) is tested by tests/e2e/test_federated.py on real servers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.alert_comparison import alert_names, comparison_file, renamed, run_comparison
from tests.support import REPO

ONE_SERVER = REPO / "prometheus" / "rules"
SHARDED = REPO / "prometheus" / "sharded"
UNIT_TESTS = sorted((REPO / "prometheus" / "tests").glob("*_test.yml"))


def _compare(tmp_path: Path, unit_test: Path, global_texts: dict[str, str] | None = None) -> tuple[int, str]:
    one, shard, glob = tmp_path / "one", tmp_path / "shard", tmp_path / "global"
    for folder in (one, shard, glob):
        folder.mkdir()
    for path in sorted(ONE_SERVER.glob("*.yml")):
        (one / path.name).write_text(renamed(path.read_text(), "one."))
    # The shards' groups share their names with the global server's: renamed, their series kept.
    for path in sorted((SHARDED / "shard" / "rules").glob("*.yml")):
        (shard / path.name).write_text(renamed(path.read_text(), "shard.", rename_series=False))
    for path in sorted((SHARDED / "global" / "rules").glob("*.yml")):
        text = (global_texts or {}).get(path.name, path.read_text())
        (glob / path.name).write_text(text)
    reference = sorted(one.glob("*.yml"))
    tested = sorted(shard.glob("*.yml")) + sorted(glob.glob("*.yml"))
    return run_comparison(comparison_file(unit_test, tmp_path, reference, tested, alert_names(reference)))


@pytest.mark.parametrize("unit_test", UNIT_TESTS, ids=[p.stem for p in UNIT_TESTS])
def test_the_sharded_layout_raises_the_same_alerts_as_one_server(tmp_path, unit_test):
    code, said = _compare(tmp_path, unit_test)
    assert code == 0, f"one server's and the sharded layout's alerts differ on {unit_test.name}:\n{said[-6000:]}"


def test_the_comparison_fails_when_the_global_servers_alert_changes(tmp_path):
    # The hang floor 8 s -> 80 s on the global server only: the hung ranks of hangs_test.yml are named later.
    hangs = (SHARDED / "global" / "rules" / "hangs.yml").read_text()
    changed = hangs.replace("* 10, 8)", "* 10, 80)")
    assert changed != hangs, "the hang threshold is no longer written as '* 10, 8)' in hangs.yml: update this test"
    code, said = _compare(tmp_path, REPO / "prometheus" / "tests" / "hangs_test.yml", {"hangs.yml": changed})
    assert code != 0 and "RankscopeRankHung" in said, said[-3000:]
