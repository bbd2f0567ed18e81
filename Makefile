# The two commands of the README: `make demo` runs the stack, `make test` the tests.
.PHONY: demo test lint bootstrap dashboards

# Long enough to watch dashboards and try the control CLI (about 0.1 s a step on 2 CPU cores).
DEMO_STEPS ?= 3000

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	.venv/bin/python -m trainer.stack --steps $(DEMO_STEPS)

test: bootstrap
	.venv/bin/python -m pytest

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

dashboards: bootstrap
	.venv/bin/python -m grafana.generate
