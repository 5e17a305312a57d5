from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from hivenet_router.cli import agent_main, router_main, sim_main
from hivenet_router.transport import trust
from hivenet_router.transport.identity import load_or_create


def test_gen_secret_creates_a_private_strong_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "jwt.secret"
    assert router_main(["gen-secret", str(path)]) == 0
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(trust.load_secret(str(path), "")) >= 32
    assert router_main(["gen-secret", str(path)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


def test_peer_id_prints_the_identity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    identity, _ = load_or_create(tmp_path / "id.key")
    assert agent_main(["peer-id", "--identity-path", str(tmp_path / "id.key")]) == 0
    assert capsys.readouterr().out.strip() == identity.peer_id
    assert agent_main(["peer-id", "--identity-path", str(tmp_path / "missing")]) == 2


def test_startup_refusals_name_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HIVENET_ROUTER_JWT_SECRET", raising=False)
    assert router_main([]) == 2
    assert "no shared secret" in capsys.readouterr().err
    short = tmp_path / "short"
    short.write_text("tooshort")
    assert router_main(["--jwt-secret-file", str(short)]) == 2
    assert "at least 32" in capsys.readouterr().err
    assert agent_main(["--capacity", "0"]) == 2
    assert "--capacity" in capsys.readouterr().err
    # Past what a router takes, it started, then every router refused it on every retry.
    assert agent_main(["--capacity", "1000001"]) == 2
    assert "1000001 is over 1000000, the most a router takes" in capsys.readouterr().err


def test_keygen_prints_a_ready_entry(capsys: pytest.CaptureFixture[str]) -> None:
    import hashlib

    from hivenet_router.auth.config import parse_auth

    assert router_main(["keygen", "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    raw = out.split("API key (shown once): ")[1].split()[0]
    entry = out.split("(under api.keys):\n\n")[1]
    config = parse_auth("api:\n  mode: api-key\n  keys:\n" + entry, "generated")
    assert config.keys[0].owner == "acme"
    assert config.keys[0].digest == hashlib.sha256(raw.encode()).digest()
    assert router_main(["keygen", "--tenant", ""]) == 2


@pytest.mark.parametrize("main", [router_main, agent_main, sim_main])
def test_help_never_crashes(
    main: Callable[[Sequence[str] | None], int], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "default:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tenant", "name"),
    [
        ('acme "eu"', "C:\\new"),
        ("emoji \U0001f600 and é", "# not a comment: [x], {y}"),
    ],
)
def test_keygen_escapes_what_it_writes(
    tenant: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hivenet_router.auth.config import parse_auth

    # Pasted between double quotes unescaped, these once made auth.yaml unreadable.
    assert router_main(["keygen", "--tenant", tenant, "--name", name]) == 0
    entry = capsys.readouterr().out.split("(under api.keys):\n\n")[1]
    key = parse_auth("api:\n  mode: api-key\n  keys:\n" + entry, "generated").keys[0]
    assert (key.owner, key.name) == (tenant, name)


@pytest.mark.parametrize(
    "argv", [["--tenant", "line\nbreak"], ["--name", "tab\tand \x7f"], ["--tenant", "t" * 201]]
)
def test_keygen_refuses_what_auth_yaml_would(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # A tenant or name with a control character, or too long, makes an entry that auth.yaml
    # refuses (api.keys[].metadata): refused here, where it is typed.
    assert router_main(["keygen", *argv]) == 2
    assert "printable characters" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--ledger-dns", "postgresql://billing:S3cretPw@db/ledger"],
        ["keygen", "--tenant", "acme", "--api-key", "S3cretPw"],
        ["gen-secret", "/nonexistent/x", "S3cretPw"],
    ],
)
def test_a_mistyped_flag_never_echoes_its_value(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        router_main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "S3cretPw" not in err and "unexpected argument" in err


def test_a_missing_sync_password_file_is_a_startup_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 40)
    monkeypatch.setenv("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", "true")
    store = ["--sync-store", "valkey", "--sync-addr", "valkey:6379"]
    missing = str(tmp_path / "missing")
    assert router_main([*store, "--sync-password-file", missing]) == 2
    assert f"cannot read --sync-password-file {missing}" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert router_main([*store, "--sync-password-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_a_reset_of_a_store_path_that_is_a_file_ends_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc
    import logging

    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 40)
    monkeypatch.setenv("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", "true")
    path = tmp_path / "file"
    path.write_text("")
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # setup_logging replaces them
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(gc, "freeze", lambda: None)  # run() would freeze pytest's objects
    args = ["--disk-db-path", str(path), "--reset-disk-db", "--audit-log-path", ""]
    assert router_main([*args, "--http-port", "127.0.0.1:0"]) == 1
    err = capsys.readouterr().err
    assert "cannot open the persistent store" in err and "Traceback" not in err


def test_an_unknown_log_level_fails_setup_instead_of_meaning_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import logging

    from hivenet_router.config.values import LOG_LEVELS
    from hivenet_router.runtime import setup_logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    for level in LOG_LEVELS:  # every name the option takes has a logging level
        setup_logging(f"test={level}", "text")
    with pytest.raises(ValueError, match="verbose"):
        setup_logging("verbose", "text")


def test_the_simulators_ports_are_checked_and_a_taken_one_ends_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert sim_main(["--kv-events-port", "70000"]) == 2
    assert "--kv-events-port: 70000 is not a TCP port" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert sim_main(["--port", port]) == 1
        assert sim_main(["--port", "0", "--kv-events-port", port]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    failures = [line for line in err.splitlines() if "ERROR" in line]
    assert len(failures) == 2, err
    assert f"(--port {port})" in failures[0] and "address already in use" in failures[0]
    assert f"(--kv-events-port {port})" in failures[1]
