"""Parsers for option values. Each raises ValueError with a message fit for an operator."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

# ASCII digits only: \d would also take other scripts' digits (Arabic-Indic five, then s,
# read as five seconds).
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")
# The longest duration Go's time.Duration holds (2^63 - 1 ns, about 292 years): what the Go
# router refuses as out of range is refused here too, and infinity never becomes a timeout.
MAX_DURATION = (2**63 - 1) / 1e9
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
    if not total <= MAX_DURATION:
        raise ValueError(f"{text!r} is too long (at most about 292 years, as in Go)")
    return total


_SMALL_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))


def format_duration(seconds: float) -> str:
    """The shortest exact form `duration` reads back: `2h`, `90s`, `1.5ms`, `50us`.

    Sub-millisecond values keep their unit (a rounded `0ms` in --help would hide a default
    that is not zero); `us`, not `µs`, so that help prints on any terminal."""
    if seconds == 0:
        return "0"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    for unit, size in _SMALL_UNITS:
        if seconds >= size or unit == "ns":
            # Six decimals, trailing zeros dropped: 0.0015 shows as 1.5ms, not as
            # 1.5000000000000002ms.
            number = f"{round(seconds / size, 6):f}".rstrip("0").rstrip(".")
            return f"{number}{unit}"
    raise AssertionError("unreachable")


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


def at_most(parse: Callable[[str], int], most: int, message: str) -> Callable[[str], int]:
    """`parse`, and a value over `most` refused with `message` (`{value}` in it is the
    value)."""

    def parse_bounded(text: str) -> int:
        value = parse(text)
        if value > most:
            raise ValueError(message.format(value=value))
        return value

    return parse_bounded


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
    # float() reads "nan" and "inf": neither is a usable factor or amount, and nan would
    # pass every comparison below only to fail far from the flag that set it.
    if not math.isfinite(value):
        raise ValueError(f"{text.strip()!r} is not a finite number")
    if value < 0:
        raise ValueError(f"{value} must not be negative")
    return value


def text(value: str) -> str:
    return value


def choice(*allowed: str) -> Callable[[str], str]:
    """A parser taking exactly one of `allowed` (surrounding spaces ignored)."""

    def parse(value: str) -> str:
        picked = value.strip()
        if picked not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        return picked

    return parse


def comma_list(value: str) -> tuple[str, ...]:
    # Unlike the Go agent, trim each item: "a, b" means the tags "a" and "b".
    return tuple(item.strip() for item in value.split(",") if item.strip())


def name_list(value: str) -> tuple[str, ...]:
    """A comma list that must name something: for lists that pick which parts run.

    An empty value there (often a template variable that expanded to nothing) would not
    mean "the default" but "none of them", silently: refused, as an empty value of any
    typed option is. Lists where none is a plain setting (keys, origins, tags) take it."""
    names = comma_list(value)
    if not names:
        raise ValueError("names nothing; unset it to keep the default")
    return names


# go-log's level names (GOLOG_LOG_LEVEL), with Python's "warning", and the logging level
# each means (runtime.setup_logging applies them).
LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "dpanic": logging.CRITICAL,
    "panic": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def log_level(value: str) -> str:
    """`debug`, or per subsystem `router=debug,policy=info` (a bare level sets the rest)."""
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if not parts:
        raise ValueError("empty log level (use debug, info, warn or error)")
    for part in parts:
        name, sep, level = part.rpartition("=")
        if level.strip().lower() not in LOG_LEVELS or (sep and not name.strip()):
            raise ValueError(
                f"{part!r} is not a log level: use debug, info, warn or error, "
                "or SUBSYSTEM=LEVEL,... (example: router=debug,policy=info)"
            )
    return value.strip()


@dataclass(frozen=True, slots=True)
class ListenAddress:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def listen_address(value: str) -> ListenAddress:
    """Parse `:8080`, `127.0.0.1:8080` or `[::1]:8080`.

    An empty host means every interface, IPv6 included where the machine has it (as Go's
    `:8080`): it stays empty, which the event loop's create_server binds as one IPv4 and
    one IPv6-only socket, skipping a family the kernel lacks. `0.0.0.0:8080` is IPv4 only.
    """
    raw = value.strip()
    host, sep, port_text = raw.rpartition(":")
    if not sep:
        raise ValueError(f"{value!r} is not a listen address (examples: :8080, 127.0.0.1:8080)")
    return ListenAddress(host.strip("[]"), port(port_text))


def port(value: str) -> int:
    number = integer(value)
    if not 0 <= number <= 65535:
        raise ValueError(f"{number} is not a TCP port")
    return number


def dial_port(value: str) -> int:
    """A port others connect to: 0 (let the kernel pick, fine for a listener) cannot be
    announced or dialled."""
    number = port(value)
    if number == 0:
        raise ValueError("port 0 cannot be dialled; give the port itself (1 to 65535)")
    return number


def host_port(value: str) -> ListenAddress:
    """Parse a dial address such as `localhost:50051`."""
    if "://" in value:  # `http://host:port` read as host `http` never resolved, and was
        # retried forever (found by a new user)
        raise ValueError(f"{value!r}: give HOST:PORT, without a scheme (example: router:50051)")
    if ":" not in value:  # listen_address's examples (`:8080`) are no dial addresses
        raise ValueError(f"{value!r} needs a port (example: router.example.com:50051)")
    address = listen_address(value)
    if not value.rpartition(":")[0]:
        raise ValueError(f"{value!r} needs a host (example: router.example.com:50051)")
    if address.port == 0:
        raise ValueError(f"{value!r}: port 0 cannot be dialled")
    return address


def http_url(value: str) -> str:
    parts = urlsplit(value.strip())
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL")
    # Checked here, not by the first request: a bad port would otherwise surface later as
    # a traceback from the HTTP client rather than as a refused option.
    try:
        number = parts.port
    except ValueError:
        raise ValueError("the port is not a number from 1 to 65535") from None
    if number == 0:
        raise ValueError("port 0 cannot be dialled")
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
    dial_port(match.group(3))
    return value.strip()


def split_multiaddr(value: str) -> tuple[str, int]:
    match = _MULTIADDR.match(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a dialable multiaddress")
    return match.group(2), int(match.group(3))
