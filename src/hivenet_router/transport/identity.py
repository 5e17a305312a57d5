"""Ed25519 identities and libp2p peer IDs.

The identity file holds the libp2p protobuf encoding of the private key (key type 1, then the
64-byte seed-and-public-key form Go's libp2p writes), so a Go agent's key file keeps its peer
ID here. The peer ID is the base58btc identity multihash of the protobuf public key, which
for Ed25519 always starts with `12D3KooW`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_ALPHABET = b"123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_ED25519 = 1
_PRIV_HEADER = bytes([0x08, _ED25519, 0x12, 64])
_PUB_HEADER = bytes([0x08, _ED25519, 0x12, 32])


class IdentityError(Exception):
    pass


def b58encode(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    out = bytearray()
    while number:
        number, rem = divmod(number, 58)
        out.append(_ALPHABET[rem])
    pad = len(data) - len(data.lstrip(b"\0"))
    return (bytes(_ALPHABET[0:1]) * pad + bytes(reversed(out))).decode()


def b58decode(text: str) -> bytes:
    number = 0
    for char in text.encode():
        index = _ALPHABET.find(bytes([char]))
        if index < 0:
            raise ValueError(f"invalid base58 character {chr(char)!r}")
        number = number * 58 + index
    pad = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * pad + body


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_of(public: Ed25519PublicKey) -> str:
    encoded = _PUB_HEADER + raw_public(public)
    # identity multihash: code 0x00, length, digest = the encoded key itself
    return b58encode(bytes([0x00, len(encoded)]) + encoded)


def public_key_of_peer_id(peer_id: str) -> Ed25519PublicKey:
    """Recover the Ed25519 public key embedded in a peer ID (ValueError if it is not one)."""
    data = b58decode(peer_id)
    if len(data) != 38 or data[:2] != bytes([0x00, 36]) or data[2:6] != _PUB_HEADER:
        raise ValueError("not an Ed25519 identity peer ID")
    return Ed25519PublicKey.from_public_bytes(data[6:])


@dataclass(frozen=True)
class Identity:
    private_key: Ed25519PrivateKey
    peer_id: str

    @classmethod
    def generate(cls) -> Identity:
        key = Ed25519PrivateKey.generate()
        return cls(key, peer_id_of(key.public_key()))

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def encode(self) -> bytes:
        seed = self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return _PRIV_HEADER + seed + raw_public(self.private_key.public_key())

    @classmethod
    def decode(cls, data: bytes) -> Identity:
        if len(data) != 68 or data[:4] != _PRIV_HEADER:
            raise IdentityError("not a libp2p Ed25519 private key")
        key = Ed25519PrivateKey.from_private_bytes(data[4:36])
        if raw_public(key.public_key()) != data[36:]:
            raise IdentityError("private and public halves do not match")
        return cls(key, peer_id_of(key.public_key()))


def load_or_create(path: Path) -> tuple[Identity, bool]:
    """Load the identity at `path`, or create it with mode 0600. Returns (identity, created).

    Refuses a file that other users can read, and a corrupt file: silently replacing either
    would change the agent's peer ID and lose its history.
    """
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(
                f"{path} is readable by other users (mode {mode:o}); run chmod 600 {path}"
            )
        try:
            return Identity.decode(path.read_bytes()), False
        except (IdentityError, ValueError) as exc:
            raise IdentityError(f"{path} is not a valid identity file: {exc}") from None
    identity = Identity.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(identity.encode())
    return identity, True
