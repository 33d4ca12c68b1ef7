"""The controller's TLS material: a private CA and the serving certificate it signs.

Agents pin the CA (they never trust the system store for the controller), so the CA lives as
long as the install and the serving certificate is short-lived and renewed under the same CA.
Pure functions over PEM bytes; where they are stored (a Secret, files) is the caller's business.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVING_DAYS = 90
# Renew when less than this share of the serving certificate's life is left.
RENEW_REMAINING = 1 / 3

# Secret / file keys, as cert-manager and kubernetes.io/tls Secrets name them.
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"


@dataclass(frozen=True)
class Bundle:
    """PEM bytes of the CA and of the serving pair it signed."""

    ca_cert: bytes
    ca_key: bytes
    tls_cert: bytes
    tls_key: bytes

    def as_dict(self) -> dict[str, bytes]:
        return {CA_CERT: self.ca_cert, CA_KEY: self.ca_key, TLS_CERT: self.tls_cert, TLS_KEY: self.tls_key}


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def new_ca(common_name: str = "netagent-controller-ca", days: int = CA_DAYS) -> tuple[bytes, bytes]:
    """A self-signed CA (certificate PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def issue_serving(
    ca_cert: bytes, ca_key: bytes, dns_names: Iterable[str], ips: Iterable[str] = (), days: int = SERVING_DAYS
) -> tuple[bytes, bytes]:
    """A serving certificate for the given names, signed by the CA (certificate PEM, key PEM)."""
    dns_names, ips = list(dns_names), list(ips)
    if not dns_names and not ips:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    issuer = x509.load_pem_x509_certificate(ca_cert)
    issuer_key = serialization.load_pem_private_key(ca_key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (dns_names or ips)[0])]))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
        .sign(issuer_key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def new_bundle(dns_names: Iterable[str], ips: Iterable[str] = ()) -> Bundle:
    ca_cert, ca_key = new_ca()
    tls_cert, tls_key = issue_serving(ca_cert, ca_key, dns_names, ips)
    return Bundle(ca_cert, ca_key, tls_cert, tls_key)


def names_of(cert_pem: bytes) -> tuple[set[str], set[str]]:
    """(DNS names, IP addresses) a certificate is valid for."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), set()
    return set(san.get_values_for_type(x509.DNSName)), {str(i) for i in san.get_values_for_type(x509.IPAddress)}


def needs_renewal(
    cert_pem: bytes, ca_cert: bytes, dns_names: Iterable[str], ips: Iterable[str] = (),
    now: datetime.datetime | None = None,
) -> str | None:
    """Why the serving certificate must be reissued (unparsable, other CA, names missing, late in
    its life), or None when it is good."""
    now = now or _now()
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        issuer = x509.load_pem_x509_certificate(ca_cert)
    except ValueError as e:
        return f"unparsable certificate: {e}"
    if cert.issuer != issuer.subject:
        return "signed by another CA"
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, Exception) as e:  # InvalidSignature has no common base worth naming
        return f"signature does not verify against the CA: {e.__class__.__name__}"
    have_dns, have_ips = names_of(cert_pem)
    missing = (set(dns_names) - have_dns) | (set(ips) - have_ips)
    if missing:
        return f"names missing: {', '.join(sorted(missing))}"
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    if cert.not_valid_after_utc - now < life * RENEW_REMAINING:
        return f"expires {cert.not_valid_after_utc.isoformat()}"
    return None
