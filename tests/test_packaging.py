"""What `pip install rankscope` installs: our two import names and their data, the dependencies their code imports.

The wheel is built from a copy of the checkout (as `pip install .` builds it) and looked at file by file;
it is installed into a fresh venv whose only other packages are this venv's (on its path, not installed
there), so `from rankscope import Monitor` is tried against the wheel and not the editable checkout.
The dependency checks derive what each part needs from its modules' imports (their AST), so a new
import without its requirement, or a requirement nothing imports, fails here.

"Not installed" for the extras is made real in a subprocess whose import system refuses their packages
(as a venv without them would), so those checks run without building a multi-gigabyte venv per extra.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

from tests.support import REPO

#: Where each shipped module's imports go: the core, or the extra its subpackage needs.
AREAS = {
    "rankscope.integrations.hf": "hf",
    "rankscope.integrations.lightning": "lightning",
    "rankscope.report": "report",
    "rankscope.mixin": "mixin",
    "rankscope_trainer": "trainer",
}
SOURCES = {"rankscope": REPO / "exporter" / "rankscope", "rankscope_trainer": REPO / "trainer" / "rankscope_trainer"}


def _copy_of_checkout(dest: Path) -> Path:
    """The files git would commit (tracked, or new and not ignored): no build/, egg-info or venv leftovers."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip wheel .` builds (with this venv's setuptools: no download)."""
    tmp = tmp_path_factory.mktemp("wheel")
    checkout = _copy_of_checkout(tmp / "checkout")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
         str(checkout)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (built,) = (tmp / "dist").glob("rankscope-*.whl")
    return built


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_installs_only_our_two_import_names(wheel: Path):
    tops = {name.split("/")[0] for name in _names(wheel)}
    dist_info = {top for top in tops if top.endswith(".dist-info")}
    assert tops - dist_info == {"rankscope", "rankscope_trainer"}
    assert len(dist_info) == 1


def test_the_wheel_holds_no_dev_tooling_and_every_module_and_data_file(wheel: Path):
    names = set(_names(wheel))
    for dev in ("devstack", "benchmarks", "tests", "examples", "exporter", "trainer", "prometheus", "grafana"):
        assert not [n for n in names if f"/{dev}/" in f"/{n}" or n.startswith(f"{dev}/")], dev
    assert "rankscope/control/openapi.yaml" in names
    configs = {p.name for p in (SOURCES["rankscope_trainer"] / "configs").glob("*.yaml")}
    assert configs and {f"rankscope_trainer/configs/{c}" for c in configs} <= names
    # Every module of the source tree is shipped (a subpackage without __init__.py would be left out).
    for top, root in SOURCES.items():
        modules = {
            f"{top}/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py") if "__pycache__" not in p.parts
        }
        assert modules <= names, sorted(modules - names)


def test_a_fresh_venv_with_the_wheel_imports_rankscope_from_it(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    # The dependencies come from this venv's site-packages, appended as a plain path: its .pth files (the
    # editable install of the checkout among them) are not run, so `rankscope` can only be the wheel's.
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "rankscope-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = """
import importlib.util, sys
from rankscope import Monitor
import rankscope, rankscope_trainer
print(rankscope.__file__); print(rankscope_trainer.__file__)
for name in ("devstack", "exporter", "trainer", "tests", "benchmarks"):
    print(name, importlib.util.find_spec(name) is not None)
"""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([python, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith(purelib) for line in lines[:2]), lines
    assert lines[2:] == [f"{name} False" for name in ("devstack", "exporter", "trainer", "tests", "benchmarks")]
    assert (venv / "bin" / "rankscope-ctl").exists() and (venv / "bin" / "rankscope-report").exists()


# --- dependencies derived from the imports --------------------------------------------------------


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _runtime_imports(path: Path) -> set[str]:
    """Top-level modules a file imports when it runs: `require(extra, "module", ...)` calls included;
    imports under `if TYPE_CHECKING:` and fallbacks in an `except ImportError:` handler left out."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Try):
            for child in [*node.body, *node.orelse, *node.finalbody]:
                visit(child)
            for handler in node.handlers:
                if handler.type is None or "ImportError" not in ast.unparse(handler.type):
                    visit(handler)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require":
            found.update(arg.value.split(".")[0] for arg in node.args[1:] if isinstance(arg, ast.Constant))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _area(module: str) -> str:
    return next((extra for prefix, extra in AREAS.items() if module == prefix or module.startswith(prefix + ".")),
                "core")  # fmt: skip


def _imported_distributions() -> dict[str, dict[str, list[str]]]:
    """area (core or an extra) -> distribution -> modules importing it, for every shipped module."""
    providers = importlib.metadata.packages_distributions()
    ours = set(SOURCES) | {"__future__"}
    by_area: dict[str, dict[str, list[str]]] = {}
    for top, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            module = ".".join([top, *path.relative_to(root).with_suffix("").parts])
            for name in _runtime_imports(path) - ours - set(sys.stdlib_module_names):
                assert name in providers, f"{module} imports {name}, which no installed distribution provides"
                for dist in providers[name]:
                    by_area.setdefault(_area(module), {}).setdefault(_canonical(dist), []).append(module)
    return by_area


def _declared(requirements: list[str]) -> set[str]:
    return {_canonical(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]) for req in requirements}


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_core_dependencies_are_what_the_core_imports(project: dict):
    imported = _imported_distributions()["core"]
    assert _declared(project["dependencies"]) == set(imported), imported


@pytest.mark.parametrize("extra", sorted(set(AREAS.values())))
def test_each_extra_holds_what_its_modules_import_beyond_the_core(project: dict, extra: str):
    imported = _imported_distributions().get(extra, {})
    needed = set(imported) - _declared(project["dependencies"])
    assert _declared(project["optional-dependencies"][extra]) == needed, imported


def test_nothing_caps_torch_or_torchvision(project: dict):
    everything = [*project["dependencies"], *(r for reqs in project["optional-dependencies"].values() for r in reqs)]
    for req in everything:
        if _canonical(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]) in ("torch", "torchvision"):
            assert "<" not in req, f"{req}: a cap downgrades a newer torch; state the tested version instead"


# --- the light install ----------------------------------------------------------------------------

#: A first line for `python -c`: imports of these top-level packages fail as if they were not installed.
_BLOCK = """
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _NotInstalled())
"""
#: The extras' packages, and PyYAML: the core imports it only to read a web config file it is given.
EXTRAS_ONLY = ["transformers", "accelerate", "torchvision", "PIL", "lightning", "matplotlib", "yaml"]


def _python(code: str, blocked: list[str]) -> subprocess.CompletedProcess[str]:
    script = _BLOCK.format(blocked=set(blocked)) + code
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANKSCOPE_LOG_LEVEL": "warning"}
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)


def test_the_exporter_imports_records_and_serves_without_any_extra():
    code = """
import urllib.request
from rankscope import Monitor, MonitorConfig, RankIdentity
from rankscope.control import ControlChannel, ControlConfig
config = MonitorConfig(host="127.0.0.1", base_port=0, page_cache_seconds=0)
monitor = Monitor(config, RankIdentity("light", 0, 0, 1, "n"))
monitor.start()
with monitor.step():
    pass
page = urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}/metrics", timeout=10).read().decode()
assert "rankscope_steps_total" in page, page[:300]
ControlChannel(ControlConfig(endpoint=False)).close()
monitor.close()
print("served")
"""
    result = _python(code, EXTRAS_ONLY)
    assert result.returncode == 0 and result.stdout.strip() == "served", result.stderr


def test_rankscope_ctl_needs_no_torch():
    code = """
import sys
from rankscope.cli import main
code = main(["--url", "http://127.0.0.1:1", "status"])
assert "torch" not in sys.modules, "rankscope-ctl imported torch"
sys.exit(code)
"""
    result = _python(code, ["torch", *EXTRAS_ONLY])
    assert result.returncode == 1, result.stderr  # a one-line "cannot reach" error, not an ImportError
    assert result.stderr.strip().splitlines() == [
        "rankscope-ctl: cannot reach http://127.0.0.1:1 (is the job running, and is this its control port?)"
    ]


def test_an_integration_without_its_extra_names_the_extra_in_one_line():
    for module, extra in (
        ("rankscope.integrations.hf.callback", "hf"),
        ("rankscope.integrations.lightning.callback", "lightning"),
        ("rankscope_trainer.loop", "trainer"),
    ):
        result = _python(f"import {module}", EXTRAS_ONLY)
        assert result.returncode == 1, module
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: ") and f"pip install 'rankscope[{extra}]'" in last, (module, last)
