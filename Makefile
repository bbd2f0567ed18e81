# The two commands of the README: `make demo` runs the stack, `make test` the tests (`make test-fast`: the quick subset).
.PHONY: demo test test-fast lint bootstrap dashboards rules report compose-check

# Long enough to watch dashboards and try the control CLI, and for the divergence scenario's rollback (about 0.1 s
# a step on 2 CPU cores: ~7 minutes).
DEMO_STEPS ?= 4000
# The fault injected partway through (none, nonfinite, divergence, straggler, hang; see devstack/narrator.py).
SCENARIO ?= nonfinite
# MTLS=1: the whole loop over TLS with client certificates (throwaway CA in .stack/certs; docs/security.md).
MTLS ?=

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	.venv/bin/python -m devstack.stack --steps $(DEMO_STEPS) --scenario $(SCENARIO) $(if $(MTLS),--mtls)

# The run report of the demo (while `make demo` runs; on exit the demo writes .stack/report.html itself).
# The demo writes its Prometheus's address (a free port if 9090 was taken) to .stack/prometheus-url.
PROMETHEUS_URL ?= $(shell cat .stack/prometheus-url 2>/dev/null || echo http://127.0.0.1:9090)
report: bootstrap
	.venv/bin/rankscope-report --prometheus $(PROMETHEUS_URL) --log .stack/log.jsonl --out .stack/report.html

# Two test processes, a file each at a time (--dist loadfile keeps a file's servers and fixtures in one
# process): most of the suite waits on events (a rule's `for`, a scrape, a hang threshold), so on 2 cores
# the suite takes about 26 minutes instead of 49, every test passing with the other worker's beside it.
TEST_WORKERS ?= 2
test: bootstrap
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The edit-test loop: a few minutes instead of about 26 on 2 cores. Unit tests only: no e2e, no integration
# (real torchrun, Prometheus, Alertmanager), and not the slowest of the rest, each 30 s or more here (a wheel
# build, fresh Pythons importing torch, a 64-panel figure, a compiled model). `make test` runs them all (CI).
FAST_SKIP = --ignore=tests/test_packaging.py --ignore=tests/test_logging.py --ignore=tests/test_benchmarks_run.py \
	--ignore=tests/test_stack.py --ignore=tests/test_trainer_faults.py --ignore=tests/test_hf_recovery.py \
	--deselect tests/test_report_plots.py::test_small_multiples_give_every_one_of_64_ranks_a_panel_and_frame_the_straggler_in_red \
	--deselect tests/test_report_layout.py::test_the_ranks_titles_fit_their_panels \
	--deselect tests/test_trainer_model.py::test_the_model_can_fit_a_batch_of_shapes \
	--deselect tests/test_fidelity.py::test_a_compiled_model_trains_bit_identically_under_the_monitor_without_a_graph_break \
	--deselect tests/test_lightning_callback.py::test_without_a_control_token_the_run_stops_with_one_line_and_no_traceback \
	--deselect tests/test_hf_callback.py::test_without_a_control_token_the_run_stops_with_one_line_and_no_traceback \
	--deselect tests/test_trainer_config.py::test_the_command_line_reports_a_bad_setting_in_one_line_and_exits_2
test-fast: bootstrap
	.venv/bin/python -m pytest -m "not e2e and not integration" $(FAST_SKIP) --durations=5

# ruff on the whole tree; mypy on the shipped packages (configured in pyproject.toml's [tool.mypy]).
lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

# The rule pack (rules, dashboards, Alertmanager routes, Kubernetes resources) from rankscope/mixin/config.py.
dashboards rules: bootstrap
	.venv/bin/rankscope-mixin --kubernetes
	.venv/bin/rankscope-mixin --layout sharded

# The compose files need Docker Compose v2; one line says whether this machine's Compose is one (COMPOSE=...).
compose-check:
	@scripts/compose_check.sh
