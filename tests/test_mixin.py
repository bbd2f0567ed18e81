"""rankscope-mixin, the installed command: its default output is the repository's committed rule pack, byte
for byte; its Kubernetes resources carry the same groups and dashboards; bad settings fail in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO

#: Every file the command writes with --kubernetes, relative to --out, and where the repository commits it.
COMMITTED = [
    *sorted(p.relative_to(REPO) for p in (REPO / "prometheus" / "rules").glob("*.yml")),
    *sorted(p.relative_to(REPO) for p in (REPO / "grafana" / "dashboards").glob("*.json")),
    Path("alertmanager") / "alertmanager.yml",
    Path("kubernetes") / "prometheusrule.yaml",
    Path("kubernetes") / "grafana-dashboards.yaml",
]


def mixin(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The console script the package installs, as a user runs it."""
    exe = shutil.which("rankscope-mixin", path=str(Path(sys.executable).parent))
    assert exe, "rankscope-mixin is not installed beside this Python (pip install -e '.[dev]')"
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixin")
    result = mixin("--kubernetes", cwd=out)  # default --out: the current directory
    assert result.returncode == 0, result.stderr
    return out


def test_the_installed_command_reproduces_the_committed_files_byte_for_byte(generated: Path):
    written = sorted(p.relative_to(generated) for p in generated.rglob("*") if p.is_file())
    assert written == sorted(COMMITTED)
    for relative in COMMITTED:
        assert (generated / relative).read_bytes() == (REPO / relative).read_bytes(), f"{relative} is stale"


def test_check_passes_on_the_repository_and_names_a_stale_or_obsolete_file(generated: Path):
    assert mixin("--check", "--kubernetes", cwd=REPO).returncode == 0
    (generated / "alertmanager" / "alertmanager.yml").write_text("route: {}\n")
    leftover = generated / "prometheus" / "rules" / "alerts.yml"
    leftover.write_text((generated / "prometheus" / "rules" / "training.yml").read_text())
    result = mixin("--check", "--kubernetes", cwd=generated)
    assert result.returncode == 1
    assert "alertmanager.yml" in result.stderr and "alerts.yml (no area generates it)" in result.stderr
    # Writing again removes the rule file no area generates any more.
    assert mixin("--kubernetes", cwd=generated).returncode == 0 and not leftover.exists()
    assert mixin("--check", "--kubernetes", cwd=generated).returncode == 0


def test_the_prometheusrule_holds_exactly_the_rule_files_groups(generated: Path):
    resource = yaml.safe_load((generated / "kubernetes" / "prometheusrule.yaml").read_text())
    assert resource["apiVersion"] == "monitoring.coreos.com/v1" and resource["kind"] == "PrometheusRule"
    assert resource["metadata"]["name"] == "rankscope"
    assert {"prometheus": "k8s", "role": "alert-rules"}.items() <= resource["metadata"]["labels"].items()
    files = [yaml.safe_load(p.read_text()) for p in sorted((generated / "prometheus" / "rules").glob("*.yml"))]
    groups = {g["name"]: g for document in files for g in document["groups"]}
    assert {g["name"]: g for g in resource["spec"]["groups"]} == groups


def test_every_dashboard_is_a_configmap_for_grafanas_sidecar(generated: Path):
    maps = list(yaml.safe_load_all((generated / "kubernetes" / "grafana-dashboards.yaml").read_text()))
    boards = {p.name: p.read_text() for p in (generated / "grafana" / "dashboards").glob("*.json")}
    assert len(maps) == len(boards)
    found = {}
    for configmap in maps:
        assert (configmap["apiVersion"], configmap["kind"]) == ("v1", "ConfigMap")
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert configmap["metadata"]["name"].startswith("rankscope-dashboard-")
        found |= configmap["data"]
    assert found == boards
    assert all(json.loads(text)["uid"] for text in found.values())


def test_a_setting_reaches_every_output(tmp_path: Path):
    result = mixin("--set", "divergence_action=rollback", "--set", "imbalance_ratio=1.3", "--kubernetes",
                   "--out", str(tmp_path), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    training = (tmp_path / "prometheus" / "rules" / "training.yml").read_text()
    assert "action: rollback" in training
    assert "action: rollback" in (tmp_path / "kubernetes" / "prometheusrule.yaml").read_text()
    assert "1.3" in (tmp_path / "grafana" / "dashboards" / "ranks.json").read_text()


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("imbalance_ratio=abc", "imbalance_ratio"),
        ("no_such_knob=1", "no_such_knob"),
        ("runbook_url=x", "runbook_url"),
        ("slow_interval=half a minute", "slow_interval"),
    ],
)
def test_a_bad_setting_fails_in_one_line_naming_the_tunable(tmp_path: Path, setting: str, named: str):
    result = mixin("--set", setting, "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and named in result.stderr and result.stderr.startswith("rankscope-mixin:")
    assert not list(tmp_path.iterdir())


def test_the_old_generator_entry_points_are_gone():
    mixin_dir = REPO / "exporter" / "rankscope" / "mixin"
    assert not (mixin_dir / "rules.py").exists() and not (mixin_dir / "dashboards" / "rules.py").exists()
    for path in mixin_dir.rglob("*.py"):
        if path.name != "cli.py":
            assert "__main__" not in path.read_text(), f"{path}: one entry point only (rankscope.mixin.cli)"


def test_without_the_grafana_sdk_the_rules_and_routes_are_still_written(tmp_path: Path):
    # The dashboards need the `mixin` extra; the rules, routes and PrometheusRule need only the core.
    run = (
        "import sys; sys.modules['grafana_foundation_sdk'] = None\n"
        "from rankscope.mixin import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    result = subprocess.run([sys.executable, "-c", run, "--kubernetes", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "pip install 'rankscope[mixin]'" in result.stderr and result.stderr.count("\n") == 1
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert "alertmanager/alertmanager.yml" in written and "kubernetes/prometheusrule.yaml" in written
    assert not {name for name in written if name.startswith("grafana/") or "dashboards" in name}
    checked = subprocess.run([sys.executable, "-c", run, "--check", "--out", str(REPO)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert checked.returncode == 2 and "mixin extra" in checked.stderr


def test_every_action_can_be_emptied_so_that_every_alert_only_pages(tmp_path: Path) -> None:
    # docs/mixin.md: an empty `*_action` means the alert only pages; the fault campaign's loop-off arm sets
    # them all so. memory, divergence and non-finite refused "" (their declared choices had no "").
    result = mixin("--set", "*_action=", "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rules = "".join(p.read_text() for p in sorted((tmp_path / "prometheus" / "rules").glob("*.yml")))
    assert "RankscopeNonFiniteSteps" in rules and "RankscopeHostMemoryHigh" in rules
    assert "action:" not in rules


def nonfinite_alert(tmp_path: Path, *settings: str) -> dict:
    args = [part for setting in settings for part in ("--set", setting)]
    tmp_path.mkdir()
    result = mixin(*args, "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    groups = yaml.safe_load((tmp_path / "prometheus" / "rules" / "training.yml").read_text())["groups"]
    return next(r for g in groups for r in g["rules"] if r.get("alert") == "RankscopeNonFiniteSteps")


def test_the_nonfinite_alerts_rate_cut_comes_back_after_the_steps_its_tunable_gives(tmp_path: Path) -> None:
    # A burst of non-finite steps cut the fault campaign's rate for good: the alert now asks for a cut that the
    # trainer gives back (rankscope.control.lr_return), and says so; 0 keeps the cut, rollback has no return.
    shipped = nonfinite_alert(tmp_path / "shipped")
    assert shipped["annotations"]["restore_after_steps"] == "2000"
    assert "comes back 2000 steps after the reduction" in shipped["annotations"]["description"]
    shorter = nonfinite_alert(tmp_path / "shorter", "nonfinite_lr_restore_steps=500")
    assert shorter["annotations"]["restore_after_steps"] == "500"
    for setting in ("nonfinite_lr_restore_steps=0", "nonfinite_action=rollback"):
        kept = nonfinite_alert(tmp_path / setting.replace("=", "-"), setting)
        annotations = kept["annotations"]
        assert "restore_after_steps" not in annotations and "comes back" not in annotations["description"]
    bad = mixin("--set", "nonfinite_lr_restore_steps=1.5", "--out", str(tmp_path), cwd=tmp_path)
    assert bad.returncode == 2 and "nonfinite_lr_restore_steps must be a whole number" in bad.stderr
