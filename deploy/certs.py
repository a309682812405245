"""A local certificate authority for HTTPS on a test or development fleet (`edgecore up --tls`).

Life cycle: `LocalCA.create(folder)` makes a CA key and a self-signed CA certificate (ECDSA P-256, valid
`days`) in `folder` (ca.pem, ca.key; the key readable by its owner only), or `LocalCA.load(folder)` reads
one made before; `issue(name, hosts, folder)` writes `NAME.pem` (the leaf certificate, then the CA's: a
chain a client can verify with ca.pem) and `NAME.key` for a server whose addresses are `hosts` (DNS names or
IP addresses, as subjectAltName). Clients trust `ca.pem` (curl `--cacert`, the `openai` client through an
`httpx` client with `verify=`). A production fleet uses its own CA; nothing here is meant to outlive a test.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class LocalCA:
    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, folder: Path):
        self.key, self.cert, self.folder = key, cert, folder

    @property
    def ca_file(self) -> str:
        return str(self.folder / "ca.pem")

    @classmethod
    def create(cls, folder: str | Path, name: str = "edgecore local CA", days: int = 30) -> LocalCA:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        (folder / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(folder / "ca.key", _pem_key(key))
        return cls(key, cert, folder)

    @classmethod
    def load(cls, folder: str | Path) -> LocalCA:
        folder = Path(folder)
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{folder / 'ca.key'} is not an EC key")
        return cls(key, x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes()), folder)

    def issue(self, name: str, hosts: list[str], folder: str | Path | None = None, days: int = 30
              ) -> tuple[str, str]:
        """A server certificate for `hosts`; returns (certificate chain file, key file)."""
        out = Path(folder) if folder is not None else self.folder
        out.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        cert_file, key_file = out / f"{name}.pem", out / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM)
                              + self.cert.public_bytes(serialization.Encoding.PEM))
        _write_private(key_file, _pem_key(key))
        return str(cert_file), str(key_file)
