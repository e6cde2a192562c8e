"""Self-signed certificates for local mutual TLS (`distserve up --tls-dir`, tests), made with the openssl CLI.

One CA signs a certificate per role (distserve.peer_roles.ROLES), each naming its role in the subject's
OU, plus `cert.pem` for the operator (role "admin": the launcher, `distserve status`, `distserve
generate`, tests). All name localhost, 127.0.0.1 and `distserve` (set DISTSERVE_TLS_SERVER_NAME=distserve
when services dial each other by other names, e.g. in compose), for both TLS roles (server and client).

The folder holds what services may read: ca.pem, cert.pem/key.pem and roles/<role>.pem/<role>-key.pem.
The CA's key is written beside it, into `<folder>-ca/ca-key.pem` (mode 0600 in a 0700 folder), so that a
folder mounted into services (compose mounts the certificates folder) never holds what signs new
certificates. For production, bring your own PKI (docs/security.md).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from distserve.grpc_server import TlsConfig, role_cert_files
from distserve.peer_roles import ADMIN_ROLE, ROLES

SERVER_NAME = "distserve"
_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def ca_key_path(directory: str | Path) -> Path:
    """Where make_dev_certs keeps the CA's key: outside `directory`, in a sibling folder."""
    folder = Path(directory).resolve()
    return folder.with_name(folder.name + "-ca") / "ca-key.pem"


def make_dev_certs(directory: str | Path, days: int = 365) -> TlsConfig:
    """Writes ca.pem, the operator's cert.pem/key.pem and a certificate per role into directory (kept if
    already there), the CA key beside it (ca_key_path); returns the operator's TlsConfig. role_tls() gives
    a role's."""
    folder = Path(directory)
    (folder / "roles").mkdir(parents=True, exist_ok=True)
    tls = TlsConfig(tls_cert=str(folder / "cert.pem"), tls_key=str(folder / "key.pem"), tls_ca=str(folder / "ca.pem"))
    wanted = [Path(tls.tls_cert), Path(tls.tls_key), Path(tls.tls_ca)] + [
        path for role in ROLES for path in role_cert_files(folder, role)]
    if all(path.exists() for path in wanted):
        return tls
    ca_key = ca_key_path(folder)
    ca_key.parent.mkdir(mode=0o700, exist_ok=True)
    make_ca(folder / "ca.pem", ca_key, days)
    make_signed_cert(folder / "ca.pem", ca_key, Path(tls.tls_cert), Path(tls.tls_key), days, role=ADMIN_ROLE)
    for role in ROLES:
        cert, key = role_cert_files(folder, role)
        make_signed_cert(folder / "ca.pem", ca_key, cert, key, days, role=role)
    (folder / "ca.srl").unlink(missing_ok=True)
    return tls


def role_tls(tls: TlsConfig, role: str) -> TlsConfig:
    """The settings a process of `role` runs with: its role's certificate from the folder make_dev_certs
    wrote, when tls is that folder's and it has one; else tls unchanged (one certificate for all)."""
    if not tls.is_tls or not tls.tls_cert:
        return tls
    cert, key = role_cert_files(Path(tls.tls_cert).parent, role)
    if not (cert.exists() and key.exists()):
        return tls
    return TlsConfig(tls_cert=str(cert), tls_key=str(key), tls_ca=tls.tls_ca, tls_server_name=tls.tls_server_name,
                     tls_check_roles=True)


def make_ca(cert: Path, key: Path, days: int, name: str = "distserve-dev-ca") -> None:
    _openssl("req", "-x509", *_EC_KEY, "-keyout", key, "-out", cert, "-days", days, "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    key.chmod(0o600)


def make_signed_cert(ca_cert: Path, ca_key: Path, cert: Path, key: Path, days: int, role: str = "") -> None:
    """A certificate for both TLS roles (serverAuth, clientAuth) naming localhost, 127.0.0.1 and SERVER_NAME,
    with `role` as its subject's OU (distserve.peer_roles reads it) when given."""
    request = cert.with_suffix(".csr")
    extensions = cert.with_suffix(".ext")
    extensions.write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:{SERVER_NAME}\n"
                          "extendedKeyUsage=serverAuth,clientAuth\n")
    subject = (f"/O=distserve/OU={role}" if role else "") + f"/CN={SERVER_NAME}"
    _openssl("req", "-new", *_EC_KEY, "-keyout", key, "-out", request, "-subj", subject)
    _openssl("x509", "-req", "-in", request, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
             "-days", days, "-extfile", extensions)
    key.chmod(0o600)
    request.unlink()
    extensions.unlink()


def _openssl(*args) -> None:
    result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")
