"""Self-signed certificates for local mutual TLS (`distserve up --tls-dir`, tests), made with the openssl CLI.

One CA signs one certificate that every service presents, as server and as client; it names
localhost, 127.0.0.1 and `distserve` (set DISTSERVE_TLS_SERVER_NAME=distserve when services
dial each other by other names, e.g. in compose). For production, bring your own PKI.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from distserve.grpc_server import TlsConfig

SERVER_NAME = "distserve"
_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def make_dev_certs(directory: str | Path, days: int = 365) -> TlsConfig:
    """Writes ca.pem, cert.pem and key.pem into directory (kept if already there); returns their TlsConfig."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tls = TlsConfig(tls_cert=str(folder / "cert.pem"), tls_key=str(folder / "key.pem"), tls_ca=str(folder / "ca.pem"))
    if not all(Path(p).exists() for p in (tls.tls_cert, tls.tls_key, tls.tls_ca)):
        make_ca(folder / "ca.pem", folder / "ca-key.pem", days)
        make_signed_cert(folder / "ca.pem", folder / "ca-key.pem", Path(tls.tls_cert), Path(tls.tls_key), days)
    return tls


def make_ca(cert: Path, key: Path, days: int, name: str = "distserve-dev-ca") -> None:
    _openssl("req", "-x509", *_EC_KEY, "-keyout", key, "-out", cert, "-days", days, "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    key.chmod(0o600)


def make_signed_cert(ca_cert: Path, ca_key: Path, cert: Path, key: Path, days: int) -> None:
    """A certificate for both TLS roles (serverAuth, clientAuth) naming localhost, 127.0.0.1 and SERVER_NAME."""
    request = cert.with_suffix(".csr")
    extensions = cert.with_suffix(".ext")
    extensions.write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:{SERVER_NAME}\n"
                          "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-new", *_EC_KEY, "-keyout", key, "-out", request, "-subj", f"/CN={SERVER_NAME}")
    _openssl("x509", "-req", "-in", request, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
             "-days", days, "-extfile", extensions)
    key.chmod(0o600)
    request.unlink()
    extensions.unlink()


def _openssl(*args) -> None:
    result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")
