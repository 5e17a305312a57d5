"""The ledger's DSN: checked at start, and what of it must never be logged.

Apart from the pool (ledger_sql.py) so that the router's start can check a DSN without
importing asyncpg: a router without --ledger-dsn never loads the PostgreSQL driver.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import parse_qsl, unquote, urlsplit

_SSLMODES: Final = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})
_SESSION_ATTRS: Final = frozenset(
    {"any", "primary", "standby", "prefer-standby", "read-write", "read-only"}
)


def dsn_secrets(dsn: str) -> tuple[str, ...]:
    """What must never be logged: the DSN itself and its password, from the user part or a
    `password=` parameter, as written and decoded. Longest first, so that the DSN is
    replaced whole before its parts."""
    found = {dsn}
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return (dsn,)
    userinfo = parts.netloc.rpartition("@")[0]
    if ":" in userinfo:
        raw = userinfo.partition(":")[2]
        found |= {raw, unquote(raw)}
    for pair in parts.query.split("&"):
        name, _, raw = pair.partition("=")
        if unquote(name).lower() == "password":
            found |= {raw, unquote(raw), unquote(raw.replace("+", " "))}
    return tuple(sorted((s for s in found if s), key=len, reverse=True))


def redact(text: str, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def dsn_problem(dsn: str) -> str | None:
    """Why `dsn` cannot be a PostgreSQL URL, or None. For the start: a typo is refused
    there, not found by the first connection. The message never quotes the password."""
    usage = "(postgresql://user:password@host:5432/database)"
    try:
        parts = urlsplit(dsn)
    except ValueError as exc:
        # The PostgreSQL driver parses the DSN with this same function, so what it refuses
        # here could not connect either. Its own message can quote the password, so it is
        # never shown. Patched Pythons (Debian 12's 3.11.2 among them) refuse an IPv6 host
        # after a comma in a host list: the one case worth naming.
        hosts = re.split(r"[/?#]", dsn.partition("://")[2], maxsplit=1)[0].rpartition("@")[2]
        if "Invalid IPv6 URL" in str(exc) and "," in hosts.partition("[")[0]:
            return (
                "--ledger-dsn: this Python cannot read its IPv6 host; in a list of hosts, "
                f"put the IPv6 host first {usage}"
            )
        return f"--ledger-dsn is not a URL {usage}"
    if parts.scheme not in ("postgres", "postgresql"):
        return f"--ledger-dsn must start with postgresql:// {usage}"
    for host in parts.netloc.rpartition("@")[2].split(","):
        problem = _port_problem(host)
        if problem:
            return problem
    try:
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        return "--ledger-dsn: its parameters (after ?) are not name=value pairs"
    for name, value in query:
        problem = _parameter_problem(name, value)
        if problem:
            return problem
    return None


def _port_problem(host: str) -> str | None:
    if host.startswith("["):  # [IPv6]:port
        end = host.find("]")
        if end < 0:
            return "--ledger-dsn: an IPv6 host needs its closing ]"
        rest = host[end + 1 :]
        if rest and not rest.startswith(":"):
            return "--ledger-dsn: text after an IPv6 host must be :port"
        port = rest[1:]
    else:
        port = host.rpartition(":")[2] if ":" in host else ""
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"--ledger-dsn: port {port[:20]!r} is not a number from 1 to 65535"
    return None


def _parameter_problem(name: str, value: str) -> str | None:
    if name == "sslmode" and value not in _SSLMODES:
        return f"--ledger-dsn: sslmode must be one of {', '.join(sorted(_SSLMODES))}"
    if name == "target_session_attrs" and value not in _SESSION_ATTRS:
        return "--ledger-dsn: target_session_attrs must be one of " + ", ".join(
            sorted(_SESSION_ATTRS)
        )
    if name == "port" and not all(p.isdigit() and 1 <= int(p) <= 65535 for p in value.split(",")):
        return "--ledger-dsn: the port parameter is not a number from 1 to 65535"
    return None
