"""Certificates made in the test run: a CA, a server certificate for localhost / 127.0.0.1 (and
any other addresses a test's hosts have) and a client certificate it signed, and a second,
unrelated CA with its own pair (the wrong ones)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK = ipaddress.ip_address("127.0.0.1")


@dataclass(frozen=True)
class Pki:
    """PEM files of one CA and the server and client certificates it signed."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _build(subject: str, key, issuer: str, issuer_key, extensions) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    for ext, critical in extensions:
        builder = builder.add_extension(ext, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate | None = None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return path


def make_pki(folder: Path, label: str, ips: tuple[str, ...] = (), names: tuple[str, ...] = ()) -> Pki:
    """A CA, and a server certificate for localhost, 127.0.0.1 and `ips` (or for the DNS `names`
    alone, where given: a host's certificate), and a client one."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = f"specdec test CA {label}"
    ca = _build(
        ca_name,
        ca_key,
        ca_name,
        ca_key,
        [
            (x509.BasicConstraints(ca=True, path_length=None), True),
            (
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False,
                ),
                True,
            ),
        ],
    )  # fmt: skip
    paths = {"ca": _write(folder / "ca.pem", ca)}
    addresses = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    localhost = x509.SubjectAlternativeName(
        [x509.DNSName(n) for n in names] or [x509.DNSName("localhost"), x509.IPAddress(LOOPBACK), *addresses]
    )
    for role, usage, extra in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH, [(localhost, False)]),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, []),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = [(x509.BasicConstraints(ca=False, path_length=None), True), (x509.ExtendedKeyUsage([usage]), False)]
        cert = _build(f"specdec {role} {label}", key, ca_name, ca_key, leaf + extra)
        paths[f"{role}_cert"] = _write(folder / f"{role}.pem", cert)
        paths[f"{role}_key"] = _write(folder / f"{role}.key", key=key)
    return Pki(**paths)
