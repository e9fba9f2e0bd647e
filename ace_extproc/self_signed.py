"""A self-signed certificate made at start, for TLS on the ext_proc port where no
certificate is given: what the Gateway API Inference Extension's endpoint picker does
by default (its gateways encrypt the stream and do not check the certificate unless
told to). ``router.endpoint_picker.cert_file``/``key_file`` (a mounted Secret) take
its place where the gateway is told to check.

Made with ``cryptography``, imported only here: a process that never needs a
certificate never loads it.
"""

from __future__ import annotations

import datetime
import ipaddress

from ace_extproc.config import ConfigError

COMMON_NAME = "ace-extproc"
VALID_DAYS = 3650


def make(names: tuple[str, ...] = ("localhost",)) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM): an ECDSA P-256 key and a certificate for
    ``names`` (DNS names or IP addresses), signed by itself."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise ConfigError(
            "router.endpoint_picker: a self-signed certificate needs the 'cryptography' "
            "package; install it, or give cert_file and key_file"
        ) from None
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, COMMON_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert_pem, key_pem
