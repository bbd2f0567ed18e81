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
python=${PYTHON:-python3}
# Debian's python3 makes virtual environments only with python3-venv (ensurepip) installed.
"$python" -c 'import ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
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

# A venv without pip is one a failed earlier run left half made: make it again.
if [ ! -x .venv/bin/pip ]; then
  echo "bootstrap: creating .venv"
  "$python" -m venv --clear .venv
fi
stamp=.venv/.rankscope-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing the project into .venv (torch is a large download on a machine without it cached)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev]'
  touch "$stamp"
fi
