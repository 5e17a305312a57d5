"""Parsers for option values. Each raises ValueError with a message fit for an operator."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def duration(text: str) -> float:
    """Parse a Go-style duration (`500ms`, `5s`, `1h30m`, `0`) into seconds."""
    raw = text.strip()
    if raw == "0":
        return 0.0
    if not raw:
        raise ValueError("empty duration")
    pos = 0
    total = 0.0
    while pos < len(raw):
        match = _DURATION_PART.match(raw, pos)
        if match is None:
            raise ValueError(f"{text!r} is not a duration (examples: 500ms, 5s, 2m, 1h30m)")
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    return total


def format_duration(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


def positive_duration(text: str) -> float:
    value = duration(text)
    if value <= 0:
        raise ValueError(f"{text!r} must be a positive duration")
    return value


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{text!r} is not a boolean (use true or false)")


def integer(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = integer(text)
    if value <= 0:
        raise ValueError(f"{value} must be positive")
    return value


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise ValueError(f"{value} must not be negative")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{value} must be between 0 and 1")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if value < 0:
        raise ValueError(f"{value} must not be negative")
    return value


def text(value: str) -> str:
    return value


def comma_list(value: str) -> tuple[str, ...]:
    # Unlike the Go agent, trim each item: "a, b" means the tags "a" and "b".
    return tuple(item.strip() for item in value.split(",") if item.strip())


@dataclass(frozen=True, slots=True)
class ListenAddress:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def listen_address(value: str) -> ListenAddress:
    """Parse `:8080`, `127.0.0.1:8080` or `[::1]:8080`. An empty host means every interface."""
    raw = value.strip()
    host, sep, port_text = raw.rpartition(":")
    if not sep:
        raise ValueError(f"{value!r} is not a listen address (examples: :8080, 127.0.0.1:8080)")
    host = host.strip("[]") or "0.0.0.0"
    return ListenAddress(host, port(port_text))


def port(value: str) -> int:
    number = integer(value)
    if not 0 <= number <= 65535:
        raise ValueError(f"{number} is not a TCP port")
    return number


def host_port(value: str) -> ListenAddress:
    """Parse a dial address such as `localhost:50051`."""
    address = listen_address(value)
    if not value.rpartition(":")[0]:
        raise ValueError(f"{value!r} needs a host (example: router.example.com:50051)")
    return address


def http_url(value: str) -> str:
    parts = urlsplit(value.strip())
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise ValueError(f"{value!r} is not an http(s) URL")
    return value.strip().rstrip("/")


def optional_http_url(value: str) -> str:
    return http_url(value) if value.strip() else ""


_MULTIADDR = re.compile(r"^/(ip4|ip6|dns4|dns6|dns)/([^/]+)/tcp/(\d+)(/tls/ws|/wss|/ws)?/?$")


def multiaddr(value: str) -> str:
    """Validate a dialable multiaddress such as `/dns4/router.example.com/tcp/9000`."""
    if not value:
        return ""
    match = _MULTIADDR.match(value.strip())
    if match is None:
        raise ValueError(
            f"{value!r} is not a dialable multiaddress (example: /dns4/router.example.com/tcp/9000)"
        )
    port(match.group(3))
    return value.strip()


def split_multiaddr(value: str) -> tuple[str, int]:
    match = _MULTIADDR.match(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a dialable multiaddress")
    return match.group(2), int(match.group(3))
