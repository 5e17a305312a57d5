"""Parsers of option values (config/values.py): what each refuses, and that what the help
shows reads back."""

from __future__ import annotations

import pytest

from hivenet_router.config import values


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.00005, "50us"),
        (0.0004, "400us"),
        (0.0015, "1.5ms"),
        (1e-7, "100ns"),
        (0.25, "250ms"),
        (2.5, "2.5s"),
        (90.0, "90s"),
        (5400.0, "90m"),
        (7200.0, "2h"),
        (0.0, "0"),
    ],
)
def test_format_duration_is_exact_and_reads_back(seconds: float, shown: str) -> None:
    # Sub-millisecond defaults once showed as "0ms" in --help and the docs.
    assert values.format_duration(seconds) == shown
    assert values.duration(shown) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    [
        "\u0665s",  # ARABIC-INDIC DIGIT FIVE: \d took it as 5
        "100000000000000000h",  # beyond what Go's time.Duration holds
        "9" * 400 + "h",  # float() reads it as infinity
    ],
)
def test_durations_are_ascii_and_bounded(text: str) -> None:
    with pytest.raises(ValueError):
        values.duration(text)


def test_the_longest_go_duration_is_still_taken() -> None:
    assert values.duration("2562047h") == 2562047 * 3600.0


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "infinity"])
def test_non_negative_float_refuses_what_is_not_finite(text: str) -> None:
    with pytest.raises(ValueError, match="finite"):
        values.non_negative_float(text)
    assert values.non_negative_float("0.5") == 0.5


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:99999",
        "http://localhost:abc",
        "https://api.openai.com:abc",
        "http://localhost:0",
        "http://:8000",
    ],
)
def test_http_url_checks_the_port_and_host(url: str) -> None:
    with pytest.raises(ValueError):
        values.http_url(url)


def test_http_url_takes_a_good_url() -> None:
    assert values.http_url("http://[::1]:8000/") == "http://[::1]:8000"
    assert values.http_url("https://api.example.com") == "https://api.example.com"


def test_port_zero_is_not_a_dial_address() -> None:
    with pytest.raises(ValueError, match="port 0"):
        values.dial_port("0")
    with pytest.raises(ValueError, match="port 0"):
        values.host_port("router.example.com:0")
    with pytest.raises(ValueError, match="port 0"):
        values.multiaddr("/dns4/r.example/tcp/0")
    assert values.dial_port("9000") == 9000
    assert values.port("0") == 0  # a listener may still let the kernel choose


def test_an_empty_listen_host_means_every_interface() -> None:
    every = values.listen_address(":8080")
    # Empty, not 0.0.0.0: create_server binds IPv6 as well as IPv4 for it.
    assert (every.host, every.port, str(every)) == ("", 8080, ":8080")
    assert values.listen_address("0.0.0.0:8080").host == "0.0.0.0"
    assert str(values.listen_address("[::1]:8080")) == "[::1]:8080"


@pytest.mark.parametrize("text", ["", " ", ",", " , ,"])
def test_a_name_list_must_name_something(text: str) -> None:
    with pytest.raises(ValueError, match="names nothing"):
        values.name_list(text)
    assert values.comma_list(text) == ()  # lists whose default is empty still take it


def test_choice_takes_only_its_values() -> None:
    parse = values.choice("none", "api-key")
    assert parse(" api-key ") == "api-key"
    for wrong in ("api_key", "None", "", "static"):
        with pytest.raises(ValueError, match="none, api-key"):
            parse(wrong)


@pytest.mark.parametrize("text", ["debug", "WARN", "router=debug,policy=info", "info,p2p=error"])
def test_log_levels_taken(text: str) -> None:
    assert values.log_level(text) == text


@pytest.mark.parametrize("text", ["", "verbose", "router=verbose", "=debug", "debug,trace"])
def test_log_levels_refused(text: str) -> None:
    with pytest.raises(ValueError):
        values.log_level(text)


def test_a_dial_address_with_a_scheme_is_refused_at_start() -> None:
    # Found by a new user: http://host:port was read as host "http", never resolved, and
    # the agent retried it forever.
    for value in ("http://127.0.0.1:50051", "https://router:50051"):
        with pytest.raises(ValueError, match="without a scheme"):
            values.host_port(value)
