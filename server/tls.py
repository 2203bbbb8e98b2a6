"""The TLS files `serve` is given, checked before gRPC sees them: gRPC reports a certificate it cannot use only as
"Failed to bind to address", so each file's fault is found here and named with its flag and path.

Invariant: what passes is a PEM certificate chain, a PEM private key whose public key is the chain's first
certificate's, and (for mutual TLS) a PEM bundle of CA certificates. Nothing here decides trust; gRPC does.
"""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from handoff_client.protocol.errors import ManifestError


def check_tls_files(cert: tuple[str, bytes], key: tuple[str, bytes], client_ca: tuple[str, bytes] | None) -> None:
    """Each argument is (the flag and path as the user gave them, the file's bytes); ManifestError naming the flag
    and the file for the first that cannot serve TLS."""
    chain = _certificates(*cert)
    where, data = key
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ManifestError(f"{where}: not an unencrypted PEM private key") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if private.public_key().public_bytes(encoding, public) != chain[0].public_key().public_bytes(encoding, public):
        raise ManifestError(f"{where}: this key is not the key of the certificate in {cert[0]}")
    if client_ca is not None:
        _certificates(*client_ca)


def _certificates(where: str, data: bytes) -> list[x509.Certificate]:
    try:
        chain = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ManifestError(f"{where}: no PEM certificate in it (-----BEGIN CERTIFICATE-----)") from None
    return chain
