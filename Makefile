# The two commands of the README: `make demo` runs the stack, `make test` the tests.
.PHONY: demo test lint bootstrap dashboards rules report compose-check

# Long enough to watch dashboards and try the control CLI (about 0.1 s a step on 2 CPU cores: ~5 minutes).
DEMO_STEPS ?= 3000
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

test: bootstrap
	.venv/bin/python -m pytest

# ruff on the whole tree; mypy on the shipped packages (configured in pyproject.toml's [tool.mypy]).
lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

# The rule pack (rules, dashboards, Alertmanager routes, Kubernetes resources) from rankscope/mixin/config.py.
dashboards rules: bootstrap
	.venv/bin/rankscope-mixin --kubernetes

# The compose files need Docker Compose v2; one line says whether this machine's Compose is one (COMPOSE=...).
compose-check:
	@scripts/compose_check.sh
