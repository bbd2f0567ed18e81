"""The whole stack without Docker: Prometheus, Alertmanager and a trainer under torchrun.

    python -m devstack.stack     # `make demo`: 2 CPU ranks of trainer/rankscope_trainer/configs/demo.yaml
    python -m devstack.stack --nproc 4 --steps 2000 --set faults.straggler.rank=1

It runs the ``prometheus`` and ``prometheus-alertmanager`` binaries of the
system with the repository's own config files, changing only addresses: the
compose service names (``trainer:9400``, ``alertmanager:9093``, ...) become
127.0.0.1 and the ports chosen here, the scrape job lists one target per rank,
and the webhook's token file is the one this launcher uses (`devstack.monitoring`, the
local stack of the benchmarks and the e2e tests too). The derived files,
logs, data, checkpoints and the control token live in the run directory
(``.stack/``). Ctrl-C (or SIGTERM) stops everything it started, after writing
the run report (``report.html`` and ``report.png`` there; docs/report.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from rankscope.control.client import ClientTls
from rankscope_trainer.config import ConfigError, add_overrides_option, load_config

from devstack.certs import Certs, make_certs, use_mtls, write_web_config
from devstack.monitoring import INSTALL_HINT, MonitoringStack
from devstack.narrator import SCENARIOS, Narrator, PagerSink
from devstack.ports import Ports, free_port_block, port_is_free
from devstack.processes import Child, Children, StackError, find_binaries

__all__ = ["choose_ports", "main"]

REPO = Path(__file__).resolve().parent.parent


def _token_file(run_dir: Path) -> Path:
    """The control token the trainer requires and Alertmanager sends; made once, readable by the owner only."""
    path = run_dir / "control-token"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as token:
            token.write(secrets.token_urlsafe(32) + "\n")
    return path


_FLAGS = {"prometheus": "--prometheus-port", "alertmanager": "--alertmanager-port", "control": "--control-port",
          "metrics": "--metrics-port"}  # fmt: skip


def choose_ports(args: argparse.Namespace, pager: int | None = None) -> Ports:
    """The ports of this stack. One given on the command line must be free (else a one-line error naming
    its flag); a default that is taken (say, by a Prometheus of your own on 9090) is replaced by a free
    port, said on stdout: the stack never disturbs a server it did not start."""
    chosen: dict[str, int] = {}
    for name, default in (("prometheus", Ports.prometheus), ("alertmanager", Ports.alertmanager),
                          ("control", Ports.control), ("metrics", Ports.metrics)):  # fmt: skip
        given = getattr(args, f"{name}_port")
        port = default if given is None else given
        width = args.nproc if name == "metrics" else 1
        if all(port_is_free(port + offset) for offset in range(width)) and port not in chosen.values():
            chosen[name] = port
            continue
        what = f"ports {port}-{port + width - 1}" if width > 1 else f"port {port}"
        if given is not None:
            raise StackError(f"{what} ({name}) already in use; choose another with {_FLAGS[name]}")
        chosen[name] = free_port_block(width)
        print(f"devstack.stack: {what} ({name}) is taken; using {chosen[name]} instead ({_FLAGS[name]} to choose)")
    pager = args.pager_port if pager is None else pager  # the demo's own sink unless --pager-port names one
    return Ports(chosen["prometheus"], chosen["alertmanager"], chosen["metrics"], chosen["control"], pager)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devstack.stack", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks on this machine (torchrun --nproc_per_node)")
    parser.add_argument("--steps", type=int, default=None, help="run.max_steps (default: the config's)")
    parser.add_argument("--config", type=Path, default=REPO / "trainer" / "rankscope_trainer" / "configs" / "demo.yaml")
    add_overrides_option(parser)
    parser.add_argument("--run-dir", type=Path, default=REPO / ".stack", help="derived configs, logs, data, token")
    taken = "; a taken default is replaced by a free port"
    parser.add_argument("--prometheus-port", type=int, help=f"default {Ports.prometheus}{taken}")
    parser.add_argument("--alertmanager-port", type=int, help=f"default {Ports.alertmanager}{taken}")
    parser.add_argument("--metrics-port", type=int, help=f"rank r serves metrics-port + r (default {Ports.metrics})")
    parser.add_argument("--control-port", type=int, help=f"default {Ports.control}{taken}")
    parser.add_argument(
        "--pager-port",
        type=int,
        default=None,
        help="a webhook of your own on 127.0.0.1 receiving the pages (default: the demo's sink, which prints them)",
    )
    parser.add_argument(
        "--mtls",
        action="store_true",
        help="serve both endpoints over TLS with client certificates (a throwaway CA in RUN_DIR/certs): Prometheus "
        "scrapes and Alertmanager calls the trainer with client certificates (docs/security.md)",
    )
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="nonfinite",
        help="the fault the demo injects partway through, to show an alert turning into an action (default nonfinite)",
    )
    args = parser.parse_args(argv)
    args.started_at = time.time()  # names a restarting scenario's checkpoint folder (checkpoint_dir)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if not args.config.is_file():
        parser.error(f"--config {args.config} is not a file")
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        parser.error(str(exc))
    # The run's own run_id (one --set run.run_id=... gives, else new per launch): the narration, the pages
    # and the report speak of it only, not of an earlier demo whose data Prometheus keeps in the run dir.
    args.run_id = config.run.run_id or f"demo-{args.scenario}-{int(args.started_at)}"
    fault_step = SCENARIOS[args.scenario].fault_step
    if fault_step is not None:
        if args.steps is not None:
            steps, said = args.steps, f"--steps {args.steps}"
        else:
            steps, said = config.run.max_steps, f"the config's run.max_steps {config.run.max_steps}"
        if steps <= fault_step:
            parser.error(f"{said} ends before the {args.scenario} scenario's fault at step {fault_step}: give "
                         "more steps (make demo DEMO_STEPS=...) or --scenario none")  # fmt: skip
    return args


def checkpoint_dir(args: argparse.Namespace, run_dir: Path) -> Path:
    """Where this launch's trainer checkpoints. A scenario that restarts the group resumes from the newest
    checkpoint (`--resume auto`), so it gets a folder of its own per launch: a restarted group must find
    this launch's checkpoints, never an earlier demo's (which are kept, never deleted)."""
    folder = run_dir / "checkpoints"
    if SCENARIOS[args.scenario].restarts:
        folder = folder / f"{args.scenario}-{int(args.started_at)}"
    return folder


def _trainer_argv(args: argparse.Namespace, ports: Ports, run_dir: Path, token: Path) -> list[str]:
    settings = [
        "metrics.host=127.0.0.1",
        f"metrics.base_port={ports.metrics}",
        "control.endpoint=true",
        "control.host=127.0.0.1",
        f"control.port={ports.control}",
        f"control.token_file={token}",
        f"checkpoint.dir={checkpoint_dir(args, run_dir)}",
        f"run.log_file={run_dir / 'log.jsonl'}",
        f"run.run_id={args.run_id}",
        *([f"run.max_steps={args.steps}"] if args.steps else []),
        *SCENARIOS[args.scenario].settings,
        *args.overrides,
    ]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    restarts = SCENARIOS[args.scenario].restarts
    if restarts:
        argv.append(f"--max-restarts={restarts}")
    argv += ["-m", "rankscope_trainer", "--config", str(args.config.resolve())]
    if restarts:
        argv += ["--resume", "auto"]  # a restarted group trains on from its newest checkpoint
    for setting in settings:
        argv += ["--set", setting]
    return argv


def _banner(ports: Ports, nproc: int, run_dir: Path, token: Path, run_id: str) -> str:
    lines = [
        "rankscope stack is up (Ctrl-C stops everything):",
        # Debian's Prometheus serves its pages under /classic/; its Alertmanager has no web UI.
        f"  Prometheus      http://127.0.0.1:{ports.prometheus}/classic/alerts",
        f"  Alertmanager    http://127.0.0.1:{ports.alertmanager}  (no web UI: amtool "
        f"--alertmanager.url=http://127.0.0.1:{ports.alertmanager} alert query)",
        *(f"  rank {r} metrics  http://127.0.0.1:{ports.metrics + r}/metrics" for r in range(nproc)),
        f"  control         http://127.0.0.1:{ports.control}/v1/status  (bearer token in {token})",
        "  Grafana         not started here: import grafana/dashboards/*.json (datasource uid rankscope-prometheus)",
        f"  logs            {run_dir / 'logs'}",
        f"  run id          {run_id}",
        f"  run report      {shlex.join(_report_argv(ports, run_dir, run_id, for_banner=True))}"
        "  (also written on exit)",
    ]
    return "\n".join(lines)


def _report_argv(ports: Ports, run_dir: Path, run_id: str, for_banner: bool = False) -> list[str]:
    """The rankscope-report command for this stack's run (the console script, if installed, in the banner)."""
    script = Path(sys.executable).parent / "rankscope-report"
    command = [str(script)] if for_banner and script.exists() else [sys.executable, "-m", "rankscope.report"]
    return [*command, "--prometheus", f"http://127.0.0.1:{ports.prometheus}", "--log", str(run_dir / "log.jsonl"),
            "--out", str(run_dir / "report.html"), "--run-id", run_id]  # fmt: skip


def _write_report(ports: Ports, run_dir: Path, run_id: str, timeout: float = 180.0) -> None:
    """Write the run report while Prometheus still runs; a failure is one line, never the launcher's exit status."""
    print(f"writing the run report to {run_dir / 'report.html'} ...", flush=True)
    try:
        command = _report_argv(ports, run_dir, run_id)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"devstack.stack: the run report was not written: {exc}", flush=True)
        return
    output = (result.stdout if result.returncode == 0 else result.stderr).strip().splitlines()
    print(output[-1] if output else f"rankscope-report exited with {result.returncode}", flush=True)


def _supervise(stop: threading.Event, monitoring: list[Child], trainer: Child) -> None:
    """Until asked to stop: fail if Prometheus or Alertmanager dies; say so once when training ends."""
    trainer_done = False
    while not stop.wait(0.5):
        for child in monitoring:
            if child.popen.poll() is not None:
                raise StackError(
                    f"{child.name} exited with code {child.popen.returncode}; log {child.log_path}:\n"
                    + child.log_tail()
                )
        if not trainer_done and trainer.popen.poll() is not None:
            trainer_done = True
            print(
                f"trainer exited with code {trainer.popen.returncode}; Prometheus and Alertmanager keep running "
                "for you to look around. Ctrl-C stops them.",
                flush=True,
            )


def _stop_trainer_gracefully(
    trainer: Child, ports: Ports, token: Path, timeout: float = 60.0, scheme: str = "http"
) -> None:
    """Ask the trainer to `stop` through its control endpoint: it checkpoints, then all ranks exit together.

    Signals would also stop it, but without that last checkpoint. If the endpoint does not take the
    request (not up yet, already stopping), the caller's signals do the job.
    """
    if trainer.popen.poll() is not None:
        return
    request = urllib.request.Request(
        f"{scheme}://127.0.0.1:{ports.control}/v1/actions",
        data=json.dumps({"action": "stop", "reason": "devstack.stack shutdown"}).encode(),
        headers={"Authorization": f"Bearer {token.read_text().strip()}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=5):
            pass
    except (urllib.error.URLError, OSError):
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        trainer.popen.wait(timeout)


def _serve_over_mtls(run_dir: Path) -> Certs:
    """A throwaway CA and certificates; the trainer (a child: it inherits the environment) serves both
    endpoints with them and requires client certificates, and this process's HTTPS requests (the
    narrator's, the final stop) present the operator's."""
    certs = make_certs(run_dir / "certs", clients=("prometheus", "alertmanager", "operator"))
    web = write_web_config(certs, certs.folder / "web.yml")
    operator = ClientTls(str(certs.ca), str(certs.client_cert("operator")), str(certs.client_key("operator")))
    os.environ.update(
        RANKSCOPE_WEB_CONFIG_FILE=str(web),
        RANKSCOPE_CONTROL_CA=operator.ca,  # rank 0 gathering stacks, and rankscope-ctl from this shell's children
        RANKSCOPE_CONTROL_CERT=operator.cert,
        RANKSCOPE_CONTROL_KEY=operator.key,
    )
    handler = urllib.request.HTTPSHandler(context=operator.ssl_context())
    urllib.request.install_opener(urllib.request.build_opener(handler))
    return certs


def run(args: argparse.Namespace) -> int:
    find_binaries(
        "prometheus", "prometheus-alertmanager", hint=INSTALL_HINT
    )  # fail before touching anything if one is missing
    # Alertmanager's pager receiver is compose's pager:9095, which does not resolve here: a local sink says each page.
    pager = PagerSink(lambda line: print(line, flush=True), run_id=args.run_id) if args.pager_port is None else None
    ports = choose_ports(args, pager.port if pager is not None else None)
    run_dir = args.run_dir.resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    token = _token_file(run_dir)
    scheme = "https" if args.mtls else "http"
    certs = _serve_over_mtls(run_dir) if args.mtls else None

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    children = Children()
    try:
        stack = MonitoringStack(run_dir, ports, args.nproc, token, children=children, log_dir=run_dir / "logs")
        if certs is not None:
            use_mtls(stack.config, stack.am_config, certs, f"http://127.0.0.1:{ports.control}")
        monitoring = stack.start().servers
        (run_dir / "prometheus-url").write_text(f"http://127.0.0.1:{ports.prometheus}\n")  # for `make report`
        if stop.is_set():  # Ctrl-C while Prometheus and Alertmanager were starting
            return 0
        # Made before the trainer starts: the run log it appends to is this run's from here on.
        narrator = Narrator(f"http://127.0.0.1:{ports.prometheus}", f"{scheme}://127.0.0.1:{ports.control}",
                            token.read_text().strip(), stacks_dir=checkpoint_dir(args, run_dir),
                            run_id=args.run_id, run_log=run_dir / "log.jsonl")  # fmt: skip
        if pager is not None:
            pager.fix_for = narrator.fix_for  # a resolved notice names what the loop applied for its alert
        # The trainer writes to this terminal: its progress lines are the demo's output.
        trainer = children.start("trainer", _trainer_argv(args, ports, run_dir, token), cwd=REPO)
        print(_banner(ports, args.nproc, run_dir, token, args.run_id), flush=True)
        print(f"  scenario        {args.scenario}: {SCENARIOS[args.scenario].expect}", flush=True)
        if certs is not None:
            print(f"  mTLS            certificates, keys and web config in {certs.folder}", flush=True)
        narrator.start()
        try:
            _supervise(stop, monitoring, trainer)
        finally:
            narrator.stop()
        print("stopping the stack: asking the trainer to checkpoint and stop ...", flush=True)
        _stop_trainer_gracefully(trainer, ports, token, scheme=scheme)
        _write_report(ports, run_dir, args.run_id)
        return 0
    finally:
        # Whatever still runs: trainer first, then Prometheus, then Alertmanager.
        children.stop_all({"trainer": 30.0})
        if pager is not None:
            pager.close()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        return run(args)
    except StackError as exc:
        print(f"devstack.stack: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
