"""Throwaway certificates for the demo and the tests: a CA, a server certificate for 127.0.0.1/localhost,
and client certificates, made with the `openssl` command (present wherever Prometheus is installed).

    certs = make_certs(Path(".stack/certs"))        # ca.crt/key, server.crt/key, client.crt/key
    other = make_certs(tmp / "other", clients=())   # another CA, for "a certificate it does not trust"
    write_web_config(certs, path)                   # exporter-toolkit web config requiring client certs

Keys are EC P-256 (a handshake costs a fraction of RSA-2048's). Never for production: the CA key sits
next to its certificate, and everything is valid for a day.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Certs", "issue", "make_certs", "use_mtls", "write_web_config"]

DAYS = 1


@dataclass(frozen=True)
class Certs:
    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.folder / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.folder / "server.key"

    def client_cert(self, name: str = "client") -> Path:
        return self.folder / f"{name}.crt"

    def client_key(self, name: str = "client") -> Path:
        return self.folder / f"{name}.key"


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError("the openssl command is needed to make certificates: sudo apt-get install openssl")
    result = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip().splitlines()[-1:]}")


def issue(folder: Path, name: str, cn: str, *, server: bool) -> None:
    """`name`.crt/.key signed by the CA in `folder` (a server's: valid for 127.0.0.1, ::1 and localhost)."""
    usage = "serverAuth" if server else "clientAuth"
    ext = [f"extendedKeyUsage={usage}", "basicConstraints=critical,CA:FALSE"]
    if server:
        ext.append("subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost")
    (folder / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=folder)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={cn}", "-out", f"{name}.csr", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", str(DAYS), "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=folder)  # fmt: skip
    (folder / f"{name}.key").chmod(0o600)


def make_certs(folder: Path, clients: tuple[str, ...] = ("client",), cn: str = "rankscope test CA") -> Certs:
    """A fresh CA in `folder`, a server certificate and one client certificate per name."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=folder)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", f"/CN={cn}", "-days", str(DAYS), "-sha256",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-out", "ca.crt", cwd=folder)  # fmt: skip
    (folder / "ca.key").chmod(0o600)
    issue(folder, "server", "127.0.0.1", server=True)
    for name in clients:
        issue(folder, name, name, server=False)
    return Certs(folder)


def write_web_config(
    certs: Certs, path: Path, client_auth: str = "RequireAndVerifyClientCert", extra: str = ""
) -> Path:
    """An exporter-toolkit web config serving `certs`' server certificate and (by default) requiring a client
    certificate from its CA."""
    path.write_text(
        "tls_server_config:\n"
        f"  cert_file: {certs.server_cert}\n"
        f"  key_file: {certs.server_key}\n"
        f"  client_auth_type: {client_auth}\n"
        f"  client_ca_file: {certs.ca}\n" + extra
    )
    return path


def use_mtls(prometheus: dict, alertmanager: dict | None, certs: Certs, control_url: str) -> None:
    """Rewrite derived configs for a stack served over mTLS: Prometheus scrapes the ranks (the `rankscope`
    job) with https and its client certificate; Alertmanager's webhooks to `control_url` (http://host:port)
    become https with Alertmanager's client certificate."""

    def tls(client: str) -> dict[str, str]:
        return {"ca_file": str(certs.ca), "cert_file": str(certs.client_cert(client)),
                "key_file": str(certs.client_key(client))}  # fmt: skip

    for job in prometheus["scrape_configs"]:
        if job["job_name"] == "rankscope":
            job["scheme"], job["tls_config"] = "https", tls("prometheus")
    for receiver in (alertmanager or {}).get("receivers", []):
        for hook in receiver.get("webhook_configs", []):
            if hook.get("url", "").startswith(control_url):
                hook["url"] = "https" + hook["url"][len("http") :]
                hook.setdefault("http_config", {})["tls_config"] = tls("alertmanager")
