"""The pieces of agent trust both sides share: the secret, the agent JWT, sessions, and the
signed proof that binds a session to the agent's peer ID. See docs/security.md."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.exceptions import InvalidSignature

from hivenet_router.transport.identity import public_key_of_peer_id

MIN_SECRET_BYTES = 32
ISSUER = "hivenet-agent"
AUDIENCE = "hivenet-router"
TOKEN_LIFETIME = 3600
CLOCK_SKEW = 30


class TrustError(Exception):
    """A secret or a token that cannot be used. Messages never contain the secret."""


def load_secret(path: str, raw: str) -> bytes:
    """The shared secret from a file (preferred) or a raw value, trimmed, at least 32 bytes."""
    if path:
        try:
            data = Path(path).read_bytes().strip()
        except OSError as exc:
            raise TrustError(f"cannot read --jwt-secret-file {path}: {exc.strerror}") from None
        origin = f"--jwt-secret-file {path}"
    elif raw:
        data = raw.strip().encode()
        origin = "HIVENET_ROUTER_JWT_SECRET"
    else:
        raise TrustError("no shared secret: set --jwt-secret-file or HIVENET_ROUTER_JWT_SECRET")
    if len(data) < MIN_SECRET_BYTES:
        raise TrustError(f"the secret from {origin} is {len(data)} bytes; at least 32 are needed")
    return data


def write_secret(path: Path) -> None:
    """Create a new random secret file readable only by its owner."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(48) + "\n")


def agent_token(secret: bytes, peer_id: str, now: float | None = None) -> str:
    issued = int(time.time() if now is None else now)
    claims = {
        "sub": peer_id,
        "iss": ISSUER,
        "aud": AUDIENCE,
        "iat": issued,
        "exp": issued + TOKEN_LIFETIME,
    }
    return jwt.encode(claims, secret, algorithm="HS256")


def verify_agent_token(secret: bytes, token: str, now: float | None = None) -> str:
    """Check signature, issuer, audience and times; return the peer ID (the subject).

    Times are checked here against `now` (the injected clock) rather than by PyJWT.
    """
    try:
        claims = jwt.decode(
            token,
            secret,
            algorithms=["HS256"],
            audience=AUDIENCE,
            issuer=ISSUER,
            options={
                "require": ["sub", "iss", "aud", "iat", "exp"],
                "verify_exp": False,
                "verify_iat": False,
                "verify_nbf": False,
            },
        )
    except jwt.PyJWTError as exc:
        raise TrustError(f"agent token rejected: {type(exc).__name__}") from None
    current = time.time() if now is None else now
    issued, expires = claims["iat"], claims["exp"]
    if not isinstance(issued, int | float) or not isinstance(expires, int | float):
        raise TrustError("agent token rejected: malformed times")
    if issued > current + CLOCK_SKEW:
        raise TrustError("agent token rejected: issued in the future")
    if expires <= current - CLOCK_SKEW:
        raise TrustError("agent token rejected: expired")
    if expires - issued > TOKEN_LIFETIME + CLOCK_SKEW:
        raise TrustError("agent token rejected: lifetime longer than one hour")
    subject = claims["sub"]
    if not isinstance(subject, str) or not subject:
        raise TrustError("agent token rejected: no subject")
    return subject


@dataclass(frozen=True, slots=True)
class SessionGrant:
    token: str
    digest: bytes
    peer_id: str
    expires_at: float
    challenge: bytes


def new_session(peer_id: str, ttl: float, now: float) -> SessionGrant:
    token = secrets.token_urlsafe(32)
    return SessionGrant(token, token_digest(token), peer_id, now + ttl, secrets.token_bytes(32))


def proof_message(challenge: bytes, peer_id: str, router_peer_id: str) -> bytes:
    """What an agent signs with its identity key to prove it owns its peer ID."""
    return b"hivenet-router session proof v1\n" + b"\n".join(
        (challenge.hex().encode(), peer_id.encode(), router_peer_id.encode())
    )


def verify_proof(signature_b64: str, challenge: bytes, peer_id: str, router_peer_id: str) -> bool:
    """True when the signature was made by the key embedded in `peer_id`."""
    try:
        signature = base64.b64decode(signature_b64, validate=True)
        public = public_key_of_peer_id(peer_id)
        public.verify(signature, proof_message(challenge, peer_id, router_peer_id))
    except (ValueError, InvalidSignature):
        return False
    return True


def token_digest(token: str) -> bytes:
    """Sessions are looked up by digest, so the table never holds a usable token."""
    return hashlib.sha256(token.encode()).digest()
