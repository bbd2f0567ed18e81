"""One line for a failed HTTP request, shared by `rankscope-ctl` and the report's Prometheus client."""

from __future__ import annotations

import requests

__all__ = ["request_failure"]

_KNOWN = ("Connection refused", "Name or service not known", "No route to host", "timed out")


def _reason(exc: BaseException) -> str:
    """The innermost cause of a requests failure, in a few words ("connection refused")."""
    text = str(exc).lower()
    for known in _KNOWN:
        if known.lower() in text:
            return known.lower()
    cause: BaseException = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return " ".join(str(cause).split())[:160]


def request_failure(exc: requests.RequestException, what: str, timeout: float, unreachable: str | None = None) -> str:
    """What went wrong asking `what` (a server, as the user knows it), in one line.

    Unreachable (refused, unknown host, no connection within `timeout`) says `unreachable` when given,
    the innermost reason otherwise; a server that took the connection but not answered in time says so.
    """
    if isinstance(exc, requests.ConnectionError):  # ConnectTimeout included: nothing ever answered
        return f"cannot reach {what} ({unreachable})" if unreachable else f"cannot reach {what}: {_reason(exc)}"
    if isinstance(exc, requests.Timeout):
        return f"{what} did not answer within {timeout:g}s"
    return f"request to {what} failed: {_reason(exc)}"
