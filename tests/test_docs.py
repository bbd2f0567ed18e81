"""The README stays a five-minute read, every link in it and in docs/ resolves, and the metrics page is current."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_the_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in _LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_metrics_page_is_generated_from_the_contract():
    result = subprocess.run(
        [sys.executable, "-m", "devstack.metrics_doc", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def _distribution(requirement: str) -> str:
    """The canonical distribution name of a requirement string ("prometheus-client>=0.20" -> prometheus-client)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def test_the_readme_names_exactly_the_core_dependencies():
    declared = {
        _distribution(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    readme = (REPO / "README.md").read_text()
    paragraph = re.search(r"^The library needs .*?(?:\n\n|\Z)", readme, flags=re.M | re.S)
    assert paragraph, "README.md: no 'The library needs ...' paragraph under Install"
    named = {_distribution(name) for name in re.findall(r"`([A-Za-z0-9_.-]+)`", paragraph.group(0))}
    assert named == declared, f"README names {sorted(named - declared)} too many, {sorted(declared - named)} missing"


# --- code the docs quote from a tested example ----------------------------------------------------------------
# A block after `<!-- verbatim: examples/X.py -->` must be lines of that file, as they are there (indentation
# taken off), so the page shows code a test runs.

_VERBATIM = re.compile(r"<!-- verbatim: (\S+) -->\n```python\n(.*?)```", flags=re.S)


def _quotes(source: Path, block: str) -> bool:
    lines, wanted = source.read_text().splitlines(), block.rstrip("\n").splitlines()
    return any(
        textwrap.dedent("\n".join(lines[start : start + len(wanted)])) == "\n".join(wanted)
        for start in range(len(lines) - len(wanted) + 1)
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_verbatim_block_is_the_example_s_own_code(page: Path):
    for name, block in _VERBATIM.findall(page.read_text()):
        assert _quotes(REPO / name, block), f"{page.relative_to(REPO)}: a block is not {name}'s code:\n{block}"


def test_the_sharded_checkpoint_and_resume_are_shown_where_the_contract_is_read():
    quoted = {
        page.name: {(name, block.splitlines()[0]) for name, block in _VERBATIM.findall(page.read_text())}
        for page in (REPO / "docs" / "instrumenting.md", REPO / "docs" / "loop-contract.md")
    }
    assert ("examples/fsdp2_loop.py", "def checkpoint(self, reason: str) -> Path:") in quoted["instrumenting.md"]
    assert ("examples/fsdp2_loop.py", "def load(self, path: Path) -> dict:") in quoted["loop-contract.md"]


# --- the documented test commands ------------------------------------------------------------------------------


def _make_variable(name: str) -> str:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    found = re.search(rf"^{name} = (.*)$", text, flags=re.M)
    assert found, f"Makefile: no {name}"
    return found.group(1)


def test_make_test_runs_the_whole_suite_and_ci_runs_make_test():
    recipe = re.search(r"^test: .*\n\t(.*)$", (REPO / "Makefile").read_text(), flags=re.M)
    assert recipe, "Makefile: no test recipe"
    command = recipe.group(1).split()
    assert command[:3] == [".venv/bin/python", "-m", "pytest"], command
    # How many processes run the tests, never which tests: no marker, keyword, path, ignore or deselect.
    assert command[3:] == ["-n", "$(TEST_WORKERS)", "--dist", "loadfile"], command
    assert re.search(r"^TEST_WORKERS \?= [1-9]\d*$", (REPO / "Makefile").read_text(), flags=re.M)
    assert "make test\n" in (REPO / ".ci" / "run").read_text()


def test_everything_the_fast_target_leaves_out_exists():
    # A renamed file or test would silently run again in test-fast: pytest ignores what it cannot find.
    for option, target in re.findall(r"--(ignore|deselect)[= ](\S+)", _make_variable("FAST_SKIP")):
        path, _, name = target.partition("::")
        assert (REPO / path).is_file(), f"FAST_SKIP: --{option} {target}: no such file"
        if name:
            assert f"def {name}(" in (REPO / path).read_text(), f"FAST_SKIP: --{option} {target}: no such test"
    for page in ("README.md", "docs/development.md"):
        assert "make test-fast" in (REPO / page).read_text(), f"{page} does not mention make test-fast"
