"""The ledger's DSN: refused at start with a message that never quotes the password, and
every form of the password redacted."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from hivenet_router.gateway.ledger_dsn import dsn_problem, dsn_secrets, redact


@pytest.mark.parametrize(
    ("dsn", "says"),
    [
        ("postgresql://billing:s3cret@db:notaport/w", "port 'notaport'"),
        ("postgresql://billing:s3cret@db:70000/w", "port '70000'"),
        ("billing:s3cret@db/w", "must start with postgresql://"),
        ("mysql://billing:s3cret@db/w", "must start with postgresql://"),
        ("postgres://billing:s3cret@db/w?sslmode=bogus", "sslmode must be one of"),
        ("postgresql://billing:s3cret@[::1/w", "not a URL"),
        ("postgresql://b@h1:5432,h2:x/w?password=s3cret", "port 'x'"),
    ],
)
def test_a_malformed_dsn_is_named_without_its_password(dsn: str, says: str) -> None:
    problem = dsn_problem(dsn)
    assert problem is not None and says in problem and "s3cret" not in problem


def test_well_formed_dsns_pass() -> None:
    for dsn in (
        "postgresql://billing:p%40ss@db:5432/wallets",
        "postgres://db/wallets?sslmode=verify-full&target_session_attrs=read-write",
        "postgresql://u@[::1]:5434,h1:5432,h2:5433/w",
        "postgresql://postgres@/wallets?host=/run/postgresql",
    ):
        assert dsn_problem(dsn) is None, dsn


def test_a_host_list_is_judged_as_the_driver_will_read_it() -> None:
    # An IPv6 host after a comma: Pythons with the bracketed-host fix refuse the whole URL,
    # and asyncpg reads the DSN with the same urlsplit, so the router must agree with it.
    dsn = "postgresql://u:s3cret@h1:5432,h2:5433,[::1]:5434/w"
    try:
        urlsplit(dsn)
    except ValueError:
        problem = dsn_problem(dsn)
        assert problem is not None and "IPv6 host first" in problem and "s3cret" not in problem
    else:
        assert dsn_problem(dsn) is None


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u:pa\u2100s3cret@db/w",  # urlsplit quotes the netloc it cannot normalize
        "postgresql://u:p[s3cret]@db/w",  # or the text between brackets it took for a host
    ],
)
def test_a_url_python_refuses_is_refused_without_its_password(dsn: str) -> None:
    problem = dsn_problem(dsn)
    assert problem is not None and "s3cret" not in problem


def test_every_form_of_the_password_is_redacted() -> None:
    dsn = "postgresql://u:p%40ss@db/w?password=hunter3&sslmode=require"
    text = f"failed: {dsn} / p@ss / p%40ss / hunter3"
    assert redact(text, dsn_secrets(dsn)) == "failed: *** / *** / *** / ***"
