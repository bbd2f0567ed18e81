# The two commands of the README: `make demo` runs the stack, `make test` the tests.
.PHONY: demo test lint bootstrap dashboards

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	.venv/bin/python -m trainer.stack

test: bootstrap
	.venv/bin/python -m pytest

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

dashboards: bootstrap
	.venv/bin/python -m grafana.generate
