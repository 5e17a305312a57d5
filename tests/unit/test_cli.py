from __future__ import annotations

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
