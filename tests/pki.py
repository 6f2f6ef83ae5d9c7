"""A throwaway PKI for the TLS tests: a CA, and certificates it signs for servers (valid for
``localhost`` and 127.0.0.1) and clients. Nothing is read from the host's trust store."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def issue(cn: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, *,
          usage: x509.ObjectIdentifier | None = None,
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``cn``: a CA when ``issuer`` is None (self-signed), else a leaf for
    ``usage`` (server or client auth) signed by ``issuer``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1)))
    if issuer is None:
        builder = builder.issuer_name(_name(cn)).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True).add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False), critical=True)
        return builder.sign(key, hashes.SHA256()), key
    ca_cert, ca_key = issuer
    builder = builder.issuer_name(ca_cert.subject).add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True)
    if usage is ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


@dataclass(frozen=True)
class Pki:
    dir: Path

    def __getattr__(self, name: str) -> str:
        """``pki.server_key`` is the path of ``server-key.pem``."""
        if name.startswith("_"):
            raise AttributeError(name)
        return str(self.dir / f"{name.replace('_', '-')}.pem")

    def der(self, name: str) -> bytes:
        return ssl.PEM_cert_to_DER_cert((self.dir / f"{name}.pem").read_text())


def make_pki(root: Path) -> Pki:
    """ca, server (and server2, for rotation), client (signed by ca) and rogue-client (signed
    by a CA the server does not trust), written to ``root``: each ``NAME.pem`` with its
    ``NAME-key.pem``."""
    ca = issue("mrc-test-ca", None)
    other_ca = issue("someone-elses-ca", None)
    made = {"ca": ca,
            "server": issue("mrc-agent", ca, usage=ExtendedKeyUsageOID.SERVER_AUTH),
            "server2": issue("mrc-agent", ca, usage=ExtendedKeyUsageOID.SERVER_AUTH),
            "client": issue("prometheus", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH),
            "rogue-client": issue("prometheus", other_ca,
                                  usage=ExtendedKeyUsageOID.CLIENT_AUTH)}
    for name, (cert, key) in made.items():
        (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{name}-key.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return Pki(root)
