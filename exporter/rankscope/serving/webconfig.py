"""The exporter-toolkit web configuration file: TLS, client certificates and basic auth for an endpoint.

    web = load_web_config("/etc/rankscope/web.yml")    # WebConfigError (one line naming the key) if malformed
    tls = web.tls                                       # None: plain HTTP
    context = tls.context()                             # re-read when a file changes: rotation without restart

The format is the one Prometheus, Alertmanager and every official exporter read (`--web.config.file`),
so an operator's existing file works unchanged:

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # NoClientCert (default) ... RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12                             # TLS10 .. TLS13
      max_version: TLS13
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # TLS 1.2 only, as in Go
    basic_auth_users:
      prometheus: $2y$10$...                         # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')

Relative file names are relative to the configuration file's folder, as in exporter-toolkit.
Settings exporter-toolkit has and this server does not honour (`http_server_config`,
`prefer_server_cipher_suites`, `curve_preferences`) are accepted and ignored, so a shared file works;
an unknown key is an error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BasicAuth", "TlsSettings", "WebConfig", "WebConfigError", "load_web_config", "web_config_for"]

logger = logging.getLogger("rankscope")

CLIENT_AUTH_TYPES = (
    "NoClientCert",
    "RequestClientCert",
    "RequireAnyClientCert",
    "VerifyClientCertIfGiven",
    "RequireAndVerifyClientCert",
)
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's names of the TLS 1.2 suites exporter-toolkit accepts, as OpenSSL names them.
_CIPHERS = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
}
_TLS_KEYS = {
    "cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
    "cipher_suites", "prefer_server_cipher_suites", "curve_preferences", "client_allowed_sans",
    "cert", "key",
}  # fmt: skip
_TOP_KEYS = {"tls_server_config", "basic_auth_users", "http_server_config"}


class WebConfigError(ValueError):
    """A web configuration file that cannot be used; the message is one line naming the key."""


@dataclass(frozen=True)
class TlsSettings:
    """tls_server_config, with file names made absolute. `context()` gives the current SSLContext."""

    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str = ""
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def verifies_clients(self) -> bool:
        return self.client_auth_type in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")

    def _files(self) -> list[str]:
        return [f for f in (self.cert_file, self.key_file, self.client_ca_file) if f]

    def _stamp(self) -> tuple:
        stamp: list[tuple[int, int, int] | None] = []
        for name in self._files():
            try:
                st = os.stat(name)
                stamp.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                stamp.append(None)
        return tuple(stamp)

    def context(self) -> ssl.SSLContext:
        """The server context, rebuilt when a certificate, key or CA file changed on disk (checked on
        every call: three stat() calls). A file being rewritten (unreadable, or cert and key that do not
        match yet) keeps the previous context, logged once per change."""
        stamp = self._stamp()
        with self._lock:
            cached = self._cache.get("context")
            if cached is not None and self._cache.get("stamp") == stamp:
                return cached
            try:
                context = self.build()
            except (OSError, ssl.SSLError, WebConfigError) as exc:
                if cached is None:
                    raise
                if self._cache.get("failed") != stamp:
                    logger.warning("rankscope: new TLS files not usable yet, keeping the previous ones: %s", exc)
                    self._cache["failed"] = stamp
                return cached
            if cached is not None:
                logger.info("rankscope: TLS certificate files changed; new connections use them")
            self._cache.update(context=context, stamp=stamp)
            return context

    def build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = _VERSIONS[self.min_version]
        context.maximum_version = _VERSIONS[self.max_version]
        if self.cipher_suites:
            context.set_ciphers(":".join(_CIPHERS[name] for name in self.cipher_suites))
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(
                f"tls_server_config.cert_file/key_file: cannot load {self.cert_file} with {self.key_file}: {exc}"
            ) from None
        if self.client_ca_file:
            try:
                context.load_verify_locations(cafile=self.client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise WebConfigError(
                    f"tls_server_config.client_ca_file: cannot load {self.client_ca_file}: {exc}"
                ) from None
        # Python can require a verified certificate, or verify one if given; it cannot accept an
        # unverified one, so RequestClientCert and RequireAnyClientCert behave as NoClientCert's
        # stricter neighbours: VerifyClientCertIfGiven and RequireAndVerifyClientCert (load checks the CA).
        context.verify_mode = {
            "NoClientCert": ssl.CERT_NONE,
            "RequestClientCert": ssl.CERT_NONE,
            "RequireAnyClientCert": ssl.CERT_REQUIRED,
            "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
            "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
        }[self.client_auth_type]
        return context


@dataclass(frozen=True)
class BasicAuth:
    """basic_auth_users: user -> bcrypt hash. Verified passwords are remembered (keyed by a SHA-256 of
    user and password), so a scrape every second costs one bcrypt per credential, not per scrape."""

    users: Mapping[str, str]
    _verified: set[bytes] = field(default_factory=set, compare=False, repr=False)

    def check(self, header: str | None) -> bool:
        """Whether an `Authorization: Basic ...` header names a user with the right password."""
        found = self._lookup(header)
        if found is None:
            return False
        key, password, hashed = found
        if any(hmac.compare_digest(key, known) for known in self._verified):
            return True
        if not _bcrypt_ok(password, hashed):
            return False
        if len(self._verified) < 1024:
            self._verified.add(key)
        return True

    def cached(self, header: str | None) -> bool:
        """check() without running bcrypt: for the I/O thread, which must never spend 100 ms on one request."""
        found = self._lookup(header)
        return found is not None and any(hmac.compare_digest(found[0], known) for known in self._verified)

    def _lookup(self, header: str | None) -> tuple[bytes, str, str] | None:
        if not header or header[:6].lower() != "basic ":
            return None
        try:
            decoded = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        user, colon, password = decoded.partition(":")
        hashed = self.users.get(user)
        if not colon or hashed is None:
            return None
        return (
            hashlib.sha256(b"\0".join((user.encode(), password.encode(), hashed.encode()))).digest(),
            password,
            hashed,
        )


def _bcrypt_ok(password: str, hashed: str) -> bool:
    import bcrypt

    try:
        return bcrypt.checkpw(password.encode("utf-8"), hashed.encode("ascii"))
    except ValueError:
        return False


@dataclass(frozen=True)
class WebConfig:
    """What one endpoint's web configuration file says; WebConfig() is plain HTTP without auth."""

    tls: TlsSettings | None = None
    basic_auth: BasicAuth | None = None
    path: str = ""

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def _fail(key: str, message: str, path: str) -> WebConfigError:
    return WebConfigError(f"web config {path}: {key}: {message}")


def load_web_config(path: str | os.PathLike[str] | None) -> WebConfig:
    """Read and check a web configuration file; None or "" is plain HTTP. The certificates are loaded
    once here, so a missing or unreadable file fails the start, not the first connection."""
    if not path:
        return WebConfig()
    import yaml  # only when a file is given: a plain endpoint needs no YAML parser

    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise WebConfigError(f"web config {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise WebConfigError(f"web config {path}: not valid YAML{where}") from None
    return parse_web_config(document or {}, path)


def parse_web_config(document: Any, path: str = "<web config>") -> WebConfig:
    """Check a parsed web configuration (see the module docstring); relative names are relative to `path`."""
    if not isinstance(document, dict):
        raise _fail("(top level)", "must be a mapping", path)
    for key in document:
        if key not in _TOP_KEYS:
            raise _fail(str(key), f"unknown key; known: {', '.join(sorted(_TOP_KEYS))}", path)
    base = Path(path).parent if path and not path.startswith("<") else Path.cwd()
    tls = _parse_tls(document.get("tls_server_config"), base, path)
    users = document.get("basic_auth_users")
    basic = None
    if users is not None:
        if not isinstance(users, dict) or not users:
            raise _fail("basic_auth_users", "must map user names to bcrypt hashes", path)
        for user, hashed in users.items():
            if (
                not isinstance(user, str)
                or not isinstance(hashed, str)
                or not hashed.startswith(("$2a$", "$2b$", "$2y$"))
            ):
                raise _fail(f"basic_auth_users.{user}", "must be a bcrypt hash ($2a$/$2b$/$2y$...)", path)
        basic = BasicAuth(dict(users))
    web = WebConfig(tls, basic, path)
    if tls is not None:
        try:
            tls.context()  # fails the start here, in one line naming the key
        except WebConfigError as exc:
            raise WebConfigError(f"web config {path}: {exc}") from None
    return web


def _parse_tls(section: Any, base: Path, path: str) -> TlsSettings | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise _fail("tls_server_config", "must be a mapping", path)
    for key in section:
        if key not in _TLS_KEYS:
            raise _fail(f"tls_server_config.{key}", "unknown key", path)
    for key in ("cert", "key"):
        if section.get(key):
            raise _fail(f"tls_server_config.{key}", f"inline PEM is not supported; use {key}_file", path)

    def text(key: str, default: str = "") -> str:
        value = section.get(key, default)
        if value is None:
            return default
        if not isinstance(value, str):
            raise _fail(f"tls_server_config.{key}", "must be a string", path)
        return value

    def file(key: str) -> str:
        name = text(key)
        return str(base / name) if name and not os.path.isabs(name) else name

    cert, key = file("cert_file"), file("key_file")
    if not cert:
        raise _fail("tls_server_config.cert_file", "is required", path)
    if not key:
        raise _fail("tls_server_config.key_file", "is required", path)
    auth = text("client_auth_type", "NoClientCert") or "NoClientCert"
    if auth not in CLIENT_AUTH_TYPES:
        raise _fail(
            "tls_server_config.client_auth_type", f"{auth!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}", path
        )
    ca = file("client_ca_file")
    if auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert") and not ca:
        raise _fail("tls_server_config.client_ca_file", f"is required with client_auth_type {auth}", path)
    versions = []
    for key_name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        value = text(key_name, default) or default
        if value not in _VERSIONS:
            raise _fail(f"tls_server_config.{key_name}", f"{value!r} is not one of {', '.join(_VERSIONS)}", path)
        versions.append(value)
    if _VERSIONS[versions[0]] > _VERSIONS[versions[1]]:
        raise _fail("tls_server_config.min_version", f"{versions[0]} is above max_version {versions[1]}", path)
    suites = section.get("cipher_suites") or []
    if not isinstance(suites, list) or any(s not in _CIPHERS for s in suites):
        raise _fail(
            "tls_server_config.cipher_suites", f"must be a list of Go TLS 1.2 suite names, got {suites!r}", path
        )
    return TlsSettings(cert, key, auth, ca, versions[0], versions[1], tuple(suites))


#: Environment variables naming a web configuration file: the endpoint's own, then the shared one.
ENV = {
    "metrics": ("RANKSCOPE_METRICS_WEB_CONFIG_FILE", "RANKSCOPE_WEB_CONFIG_FILE"),
    "control": ("RANKSCOPE_CONTROL_WEB_CONFIG_FILE", "RANKSCOPE_WEB_CONFIG_FILE"),
}


def web_config_for(endpoint: str, configured: str = "", env: Mapping[str, str] | None = None) -> WebConfig:
    """The endpoint's web configuration: its setting, else its environment variable, else the shared one."""
    env = os.environ if env is None else env
    path = configured or next((env[name] for name in ENV[endpoint] if env.get(name)), "")
    return load_web_config(path)
