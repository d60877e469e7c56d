"""A throw-away certificate authority for the test bed: CA, broker certificate and client certificate (openssl).

The brokers' certificate names every bed host (each broker serves on its own host's address) and is also a client
certificate: the brokers and controllers authenticate each other with it, as the super user ``User:CN=kbit-broker``.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kbit_core.testbed.network import TestbedError

_DAYS = "30"
BROKER_CN = "kbit-broker"


@dataclass(frozen=True)
class BedCertificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @property
    def server_keystore(self) -> Path:
        """The broker's key and certificate in one PEM file (Kafka's ``ssl.keystore.type=PEM``)."""
        return self.server_cert.with_name("server.keystore.pem")


def certificate_paths(cert_dir: Path) -> BedCertificates:
    return BedCertificates(
        cert_dir / "ca.pem",
        cert_dir / "server.pem",
        cert_dir / "server.key",
        cert_dir / "client.pem",
        cert_dir / "client.key",
    )


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise TestbedError(
            f"`openssl {args[0]}` failed while making the test bed's certificates: {proc.stderr.strip()}"
        )


def _issue(cert_dir: Path, name: str, subject: str, extensions: str, ca: Path, ca_key: Path) -> None:
    key, csr, ext = cert_dir / f"{name}.key", cert_dir / f"{name}.csr", cert_dir / f"{name}.ext"
    ext.write_text(extensions)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", subject)
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert_dir / f"{name}.pem"),
        "-days",
        _DAYS,
        "-extfile",
        str(ext),
    )
    csr.unlink()
    ext.unlink()
    key.chmod(0o600)


def make_certificates(cert_dir: Path, server_ips: list[str], server_names: list[str]) -> BedCertificates:
    """A fresh CA plus a broker certificate for ``server_ips``/``server_names`` and a client certificate, all PEM."""
    paths = certificate_paths(cert_dir)
    if shutil.which("openssl") is None:
        raise TestbedError("the `openssl` command is missing; the test bed needs it to make its TLS certificates")
    cert_dir.mkdir(parents=True, exist_ok=True)
    ca_key = cert_dir / "ca.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(paths.ca),
        "-days",
        _DAYS,
        "-subj",
        "/CN=kbit test bed CA",
    )
    ca_key.chmod(0o600)
    sans = ",".join([*(f"IP:{ip}" for ip in server_ips), *(f"DNS:{n}" for n in server_names)])
    _issue(
        cert_dir,
        "server",
        f"/CN={BROKER_CN}",
        f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n",
        paths.ca,
        ca_key,
    )
    paths.server_keystore.write_text(paths.server_key.read_text() + paths.server_cert.read_text())
    paths.server_keystore.chmod(0o600)
    _issue(
        cert_dir,
        "client",
        "/CN=kbit-client",
        "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
        paths.ca,
        ca_key,
    )
    return paths
