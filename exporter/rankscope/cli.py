"""rankscope-ctl: post control actions to a running job and read its status.

    rankscope-ctl status
    rankscope-ctl reduce-lr --factor 0.5 --reason "loss plateau" --wait 60
    rankscope-ctl pause
    rankscope-ctl stacks          # every rank's Python stacks, identical ones folded together
    rankscope-ctl --url http://10.0.0.5:9300 --token-file ~/.rankscope-token stop

The token comes from --token-file, else from the environment variable named by
--token-env (default RANKSCOPE_CONTROL_TOKEN); the URL from --url, else
RANKSCOPE_CONTROL_URL, else http://127.0.0.1:9300. Over https, --ca/--cert/--key
(or RANKSCOPE_CONTROL_CA/_CERT/_KEY) name the CA to trust and the client certificate to present.

An action command waits for the action's outcome (every rank applied it, or it was refused) and prints it,
as `kubectl rollout status` does: `--wait SECONDS` bounds the wait (default 300), `--no-wait` returns once
the job accepted it. Exit status: 0 applied (or nothing to do; with --no-wait: accepted), 1 refused,
failed, overridden or unsupported (and one-line errors), 2 bad usage, 3 no outcome within the wait.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import requests

from rankscope._requests import request_failure
from rankscope.control.catalog import CATALOG, Parameter
from rankscope.control.client import ClientTls, session_for
from rankscope.control.config import DEFAULT_TOKEN_ENV, ControlConfig, load_token
from rankscope.control.stacks import format_ranks

__all__ = ["main"]

PROG = "rankscope-ctl"
DEFAULT_URL = "http://127.0.0.1:9300"
#: command -> the action it posts (the catalog names each action's command).
_ACTION_COMMANDS = {spec.command: spec for spec in CATALOG}
_POLL_SECONDS = 0.2
DEFAULT_WAIT_SECONDS = 300.0
#: exit statuses
EXIT_APPLIED, EXIT_NOT_APPLIED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3


class CliError(Exception):
    """A failure to report in one line (exit status 1)."""

    code = EXIT_NOT_APPLIED


class WaitTimeout(CliError):
    """No outcome within --wait (exit status 3)."""

    code = EXIT_TIMEOUT


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, not a usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: {message} (see {PROG} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _parameter_type(parameter: Parameter) -> Callable[[str], float]:
    """An argparse type checking one catalog parameter, with its bounds in the error."""

    def parse(text: str) -> float:
        number = parameter.check(text)
        if number is None:
            try:
                float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
            raise argparse.ArgumentTypeError(f"must be {parameter.bounds_text()}, got {text}")
        return number

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Control a running rankscope training job.")
    parser.add_argument(
        "--url",
        default=os.environ.get("RANKSCOPE_CONTROL_URL", DEFAULT_URL),
        help=f"control endpoint (default: $RANKSCOPE_CONTROL_URL or {DEFAULT_URL})",
    )
    parser.add_argument("--token-file", default="", help="file holding the bearer token")
    parser.add_argument(
        "--token-env",
        default=DEFAULT_TOKEN_ENV,
        help=f"environment variable holding the token (default {DEFAULT_TOKEN_ENV})",
    )
    parser.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per HTTP request (default 10)")
    parser.add_argument("--ca", default="", help="CA of the endpoint's certificate (default $RANKSCOPE_CONTROL_CA)")
    parser.add_argument("--cert", default="", help="client certificate to present (default $RANKSCOPE_CONTROL_CERT)")
    parser.add_argument("--key", default="", help="the client certificate's key (default $RANKSCOPE_CONTROL_KEY)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser("status", help="print the run's status as JSON")
    commands.add_parser("health", help="check that the endpoint answers")
    stacks = commands.add_parser("stacks", help="print every rank's Python stacks, identical ones folded together")
    stacks.add_argument("--summary", action="store_true", help="only the one line naming each group's frame")
    for name, spec in _ACTION_COMMANDS.items():
        sub = commands.add_parser(name, help=spec.help)
        sub.add_argument("--reason", default="", help="recorded with the outcome (and in checkpoints)")
        waiting = sub.add_mutually_exclusive_group()
        waiting.add_argument(
            "--wait",
            type=_seconds,
            default=DEFAULT_WAIT_SECONDS,
            metavar="SECONDS",
            help=f"wait at most this long for the outcome (default {DEFAULT_WAIT_SECONDS:g}); exit 3 when none came",
        )
        waiting.add_argument("--no-wait", action="store_true", help="return once the job accepted the action")
        for parameter in spec.parameters:
            sub.add_argument(
                parameter.option,
                dest=f"param_{parameter.name}",
                type=_parameter_type(parameter),
                help=f"{parameter.help}, {parameter.bounds_text()} (default: the job's)",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code


def _run(args: argparse.Namespace) -> int:
    client = _Client(args.url, args.timeout, _token(args), _tls(args))
    if args.command == "health":
        client.call("GET", "/healthz")
        print(f"{client.base}: ok")
        return 0
    if args.command == "status":
        print(json.dumps(client.call("GET", "/v1/status"), indent=2))
        return 0
    if args.command == "stacks":
        answer = client.call("GET", "/v1/stacks")
        print(answer["summary"])
        if not args.summary:
            for group in answer["groups"]:
                print(f"\n=== {format_ranks(group['ranks'])} ===\n{group['stacks']}")
        return 0
    spec = _ACTION_COMMANDS[args.command]
    action = spec.name
    body: dict[str, Any] = {"action": action, "reason": args.reason}
    params = {p.name: getattr(args, f"param_{p.name}") for p in spec.parameters}
    params = {name: value for name, value in params.items() if value is not None}
    if params:
        body["params"] = params
    accepted = client.call("POST", "/v1/actions", body)
    action_id = accepted["id"]
    if accepted.get("status", "pending") != "pending":  # an immediate action (restart) settled at once
        detail = f" ({accepted['detail']})" if accepted.get("detail") else ""
        print(f"{action} {action_id}: {accepted['status']}{detail}")
        return 0 if accepted["status"] in ("applied", "noop") else 1
    if args.no_wait:
        print(f"accepted {action} as {action_id}")
        return EXIT_APPLIED
    print(f"accepted {action} as {action_id}; waiting for its outcome (at most {args.wait:g}s)", file=sys.stderr)
    record = _wait_for(client, action_id, args.wait, action)
    if record is None:  # a stop ends the job: its endpoint closed once the loop had left
        print(f"{action} {action_id}: the job ended (its control endpoint closed) before the outcome was read")
        return EXIT_APPLIED
    detail = f" ({record['detail']})" if record.get("detail") else ""
    print(f"{action} {action_id}: {record['status']} at step {record['step']}{detail}")
    return 0 if record["status"] in ("applied", "noop") else 1


def _token(args: argparse.Namespace) -> str | None:
    try:
        return load_token(ControlConfig(token_file=args.token_file, token_env=args.token_env))
    except ValueError as exc:
        raise CliError(
            str(exc).replace("control.token_file", "--token-file").replace("control.token_env", "--token-env")
        ) from None


def _tls(args: argparse.Namespace) -> ClientTls:
    try:
        return ClientTls.from_env(ca=args.ca, cert=args.cert, key=args.key)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _wait_for(client: _Client, action_id: str, seconds: float, action: str = "") -> dict[str, Any] | None:
    """The action's settled record; None when `action` is stop and the endpoint closed (the job ended)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            status = client.call("GET", "/v1/status")
        except CliError:
            if action == "stop" and not client.answers():
                return None
            raise
        for record in status["recent"]:
            if record["id"] == action_id:
                return record
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{action_id} still pending after {seconds:g}s (the job applies it at a step boundary)")
        time.sleep(_POLL_SECONDS)


class _Client:
    def __init__(self, base: str, timeout: float, token: str | None, tls: ClientTls | None = None) -> None:
        if not base.startswith(("http://", "https://")):
            raise CliError(f"--url must start with http:// or https://, got {base!r}")
        self.base = base.rstrip("/")
        self._timeout = timeout
        self._session = session_for(tls or ClientTls(), token)  # --ca/--cert/--key over https

    def answers(self) -> bool:
        """Whether the endpoint still accepts connections."""
        try:
            self._session.get(self.base + "/healthz", timeout=self._timeout)
        except requests.ConnectionError:
            return False
        except requests.RequestException:
            return True
        return True

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.base + path
        try:
            response = self._session.request(method, url, json=body, timeout=self._timeout)
        except requests.RequestException as exc:
            hint = "is the job running, and is this its control port?"
            raise CliError(request_failure(exc, self.base, self._timeout, unreachable=hint)) from None
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400:
            reason = data.get("error") if isinstance(data, dict) else None
            raise CliError(f"{method} {path}: {response.status_code} {response.reason}: {reason or 'no reason given'}")
        if data is None:
            raise CliError(f"{method} {path}: the answer is not JSON (is {self.base} a rankscope control endpoint?)")
        return data


if __name__ == "__main__":
    sys.exit(main())
