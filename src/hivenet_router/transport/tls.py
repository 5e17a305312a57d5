"""The router's TLS identity, derived from the shared secret, and pinned by agents.

Both sides derive the same Ed25519 key with HKDF-SHA256 (salt `hivenet-router-grpc-tls-v2`,
info `ed25519`). Every field of the self-signed certificate is fixed and Ed25519 signatures
are deterministic, so both sides build the byte-identical certificate. The agent trusts that
one certificate and nothing else: no certificate authority, no host name check, TLS 1.3 only.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

SALT = b"hivenet-router-grpc-tls-v2"
INFO = b"ed25519"
_NOT_BEFORE = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC)
# gRPC runs on HTTP/2, named "h2" in TLS's ALPN. Its clients offer it, and servers built on
# grpc-go refuse a client that offers nothing (and clients built on it, a server that
# selects nothing).
GRPC_ALPN = ("h2",)


def derive_key(secret: bytes) -> Ed25519PrivateKey:
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=SALT, info=INFO).derive(secret)
    return Ed25519PrivateKey.from_private_bytes(seed)


@dataclass(frozen=True)
class RouterTlsIdentity:
    key_pem: bytes
    cert_pem: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> RouterTlsIdentity:
        key = derive_key(secret)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hivenet-router")])
        serial = (
            int.from_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.Raw, serialization.PublicFormat.Raw
                )[:8],
                "big",
            )
            >> 1
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(serial or 1)
            .not_valid_before(_NOT_BEFORE)
            .not_valid_after(_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName("hivenet-router")]), critical=False
            )
            .sign(key, None)
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cls(key_pem, cert.public_bytes(serialization.Encoding.PEM))

    def server_context(self, alpn: Sequence[str] = ()) -> ssl.SSLContext:
        """This certificate over TLS 1.3, selecting from `alpn` a protocol the client offers
        (a client that offers none of them goes on without one)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        if alpn:
            context.set_alpn_protocols(list(alpn))
        # ssl wants files; write them to a private directory that lives only for the load.
        with tempfile.TemporaryDirectory(prefix="hivenet-tls-") as folder:
            cert_path = Path(folder) / "cert.pem"
            key_path = Path(folder) / "key.pem"
            for path, data in ((cert_path, self.cert_pem), (key_path, self.key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
            context.load_cert_chain(cert_path, key_path)
        return context

    def client_context(self, alpn: Sequence[str] = ()) -> ssl.SSLContext:
        """A context that accepts exactly this certificate, over TLS 1.3, offering the
        application protocols in `alpn` (none by default)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.cert_pem.decode())
        if alpn:
            context.set_alpn_protocols(list(alpn))
        return context
