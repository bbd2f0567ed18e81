"""The client side of a control endpoint served over TLS: which CA to trust, which certificate to present.

    tls = ClientTls.from_env()                        # RANKSCOPE_CONTROL_CA / _CERT / _KEY
    session = session_for(tls, token)                 # a requests.Session: verify, cert and the bearer token set
    urllib.request.urlopen(url, context=tls.ssl_context())

rankscope-ctl (its --ca/--cert/--key flags), rank 0 gathering the other ranks' stacks, and any
script of an operator's use the same three settings, so whatever the endpoint's web configuration
requires (a server certificate from a private CA, a client certificate), every caller presents it.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ENV", "ClientTls", "session_for"]

#: ca, cert, key
ENV = ("RANKSCOPE_CONTROL_CA", "RANKSCOPE_CONTROL_CERT", "RANKSCOPE_CONTROL_KEY")


@dataclass(frozen=True)
class ClientTls:
    ca: str = ""
    """CA bundle that signed the endpoint's certificate ("" : the system's trust store)."""
    cert: str = ""
    """Client certificate to present (for client_auth_type RequireAndVerifyClientCert)."""
    key: str = ""
    """Its private key ("" : the key is in the certificate file)."""

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"control client {name} file {path} does not exist")
        if self.key and not self.cert:
            raise ValueError("a client key without a client certificate: give --cert (RANKSCOPE_CONTROL_CERT) too")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **given: str) -> ClientTls:
        """Flags (`given`, when not empty) win over RANKSCOPE_CONTROL_CA/_CERT/_KEY."""
        env = os.environ if env is None else env
        values = {
            name: given.get(name) or env.get(var, "") for name, var in zip(("ca", "cert", "key"), ENV, strict=True)
        }
        return cls(**values)

    def ssl_context(self) -> ssl.SSLContext:
        """A client context: verifies the server (against `ca` when given) and presents `cert` when given."""
        context = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key or None)
        return context

    def requests_options(self) -> dict[str, Any]:
        """verify= and cert= for requests."""
        cert: Any = (self.cert, self.key) if self.key else (self.cert or None)
        return {"verify": self.ca or True, "cert": cert}


def session_for(tls: ClientTls | None = None, token: str | None = None) -> Any:
    """A requests.Session for a control endpoint: TLS settings from `tls` (default: the environment) and
    the bearer token, if any, on every request."""
    import requests

    class Session(requests.Session):
        def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
            # requests lets $REQUESTS_CA_BUNDLE override a session's own CA: the endpoint's CA must win.
            return super().merge_environment_settings(
                url, proxies, stream, self.verify if verify is None else verify, cert
            )

    tls = tls if tls is not None else ClientTls.from_env()
    session = Session()
    options = tls.requests_options()
    session.verify, session.cert = options["verify"], options["cert"]
    if token:
        session.headers["Authorization"] = f"Bearer {token}"
    return session
