"""A small client of the Prometheus HTTP API (`/api/v1/query`, `/api/v1/query_range`, any other path).

Works against Prometheus and Prometheus-compatible stores (VictoriaMetrics,
Thanos, Mimir, ...). Every failure is a :class:`ReportError` with one line that
says what went wrong and where: the server cannot be reached, it is not a
Prometheus API, or it refused a query (with its own reason).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import requests

from rankscope._requests import request_failure
from rankscope.report.errors import ReportError
from rankscope.report.series import Series

__all__ = ["Prometheus"]

#: Prometheus refuses range queries of more points than this per series.
MAX_POINTS = 11000


class Prometheus:
    """The HTTP API of one Prometheus (or compatible) server at `url`."""

    def __init__(self, url: str, timeout: float = 30.0, session: requests.Session | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ReportError(f"--prometheus must be an http:// or https:// URL, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._session = session or requests.Session()

    def api(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """The `data` of a successful GET of any API path (`/api/v1/alerts`, `/api/v1/rules`, ...)."""
        params = params or {}
        where = f"{self.url}{path}"
        try:
            answer = self._session.get(where, params=params, timeout=self.timeout)
        except requests.RequestException as exc:
            raise ReportError(request_failure(exc, f"Prometheus at {self.url}", self.timeout)) from None
        try:
            body = answer.json()
        except ValueError:
            kind = answer.headers.get("Content-Type", "?").split(";")[0]
            raise ReportError(
                f"{self.url} does not look like a Prometheus HTTP API: GET {path} answered {answer.status_code} "
                f"with {kind}, not JSON"
            ) from None
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error", "no reason given") if isinstance(body, dict) else "not a JSON object"
            query = params.get("query", "")
            raise ReportError(
                f"Prometheus at {self.url} refused {path} ({answer.status_code}) for {query!r}: "
                + " ".join(str(error).split())
            )
        return body.get("data")

    def ping(self) -> None:
        """Fail with a one-line ReportError unless the API answers a trivial query."""
        self.query("1")

    def query(self, expr: str, at: float | None = None) -> list[Series]:
        """An instant query evaluated at `at` (unix time; default now).

        A vector gives one point per series; a matrix (a range selector such as ``x[5m]``)
        gives every raw sample in the range, as scraped.
        """
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("/api/v1/query", params)
        kind = data.get("resultType")
        if kind == "scalar":
            return [Series({}, np.array([float(data["result"][0])]), np.array([float(data["result"][1])]))]
        return [Series.from_prometheus(item) for item in data.get("result", [])]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        """A range query: `expr` evaluated every `step` seconds from `start` to `end`."""
        if step <= 0:
            raise ValueError(f"step must be > 0, got {step}")
        points = (end - start) / step
        if points > MAX_POINTS:
            raise ValueError(f"{points:.0f} points per series is over Prometheus's limit of {MAX_POINTS}")
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        data = self.api("/api/v1/query_range", params)
        return [Series.from_prometheus(item) for item in data.get("result", [])]

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """The one value of an instant query that returns at most one series (None if empty)."""
        found = self.query(expr, at)
        if len(found) > 1:
            raise ReportError(f"expected at most one series from {expr!r}, got {len(found)}")
        return float(found[0].v[-1]) if found and len(found[0]) else None
