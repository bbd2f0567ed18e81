"""Fixtures of the end-to-end suite: a whole stack per scenario, diagnosed when its test fails."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.e2e.harness import LATENCIES, Stack
from tests.support import closing_starter, free_port_block


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    # Keeps each phase's report on the item, so a fixture's teardown knows whether its test failed.
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
    if LATENCIES:
        terminalreporter.section("rankscope e2e: fault -> action latency (target < 5s)")
        for line in LATENCIES:
            terminalreporter.write_line(line)


@pytest.fixture
def stack(request: pytest.FixtureRequest, tmp_path) -> Iterator[Callable[[str], Stack]]:
    """Call with a scenario name (and optionally engine="victoriametrics", or a Stack subclass as `kind`) to
    start its Prometheus, Alertmanager and pager sink (see tests.e2e.harness.Stack); stopped at teardown,
    after printing what every component saw if the test failed."""
    started: list[Stack] = []

    def start(name: str, engine: str = "prometheus", kind: type[Stack] = Stack) -> Stack:
        workdir = tmp_path / name
        workdir.mkdir()
        started.append(kind(workdir, name, free_port_block, engine))
        return started[-1]

    yield start
    report = getattr(request.node, "rep_call", None)
    for running in started:
        if report is not None and report.failed and "what each component saw" not in report.longreprtext:
            print(running.diagnose())
        running.close()


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Stack]]:
    """Like `stack`, for a run that several tests of a module look at; stopped at the module's end."""
    yield from closing_starter(lambda name: Stack(tmp_path_factory.mktemp(name), name, free_port_block))
