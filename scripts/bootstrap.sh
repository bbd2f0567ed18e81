#!/usr/bin/env bash
# Installs everything rankscope needs on a fresh Debian machine, idempotently:
# the Prometheus, Alertmanager and VictoriaMetrics servers and Chromium (Debian packages) and a
# virtual environment in .venv with the project and its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
# victoria-metrics, vmagent and vmalert: the VictoriaMetrics deployment's tests and benchmarks.
command -v victoria-metrics >/dev/null 2>&1 || need_apt+=(victoria-metrics)
# The run report's test renders its page headless.
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "bootstrap: installing Debian packages: ${need_apt[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# Our tests and the demo start their own servers on ports they choose; a
# Prometheus or Alertmanager already running here (the Debian packages may start
# theirs) is left alone: we never stop a process we did not start.

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  "$python" -m venv .venv
fi
stamp=.venv/.rankscope-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing the project into .venv (torch takes a minute or two)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev]'
  touch "$stamp"
fi
