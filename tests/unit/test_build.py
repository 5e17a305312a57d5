"""The build's choice of interpreter: scripts/python.sh and the Makefile's .venv rule."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_dry_run(*args: str) -> str:
    """What `make` would run for the venv, without running it."""
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), ".venv/.installed", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_the_chosen_interpreter_is_python_3_11_with_venv_and_pip() -> None:
    chosen = subprocess.run(
        [str(ROOT / "scripts" / "python.sh")], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert chosen
    check = "import sys, ensurepip, pip; print(sys.version_info[:2])"
    done = subprocess.run([chosen, "-c", check], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "(3, 11)"


def test_the_venv_is_kept_while_its_interpreter_stays() -> None:
    assert (ROOT / ".venv" / "bin" / "python").exists()
    assert "rm -rf .venv" not in make_dry_run()


def test_another_interpreter_rebuilds_the_venv(tmp_path: Path) -> None:
    other = tmp_path / "python3.11"
    other.write_text("#!/bin/sh\nexit 0\n")
    other.chmod(0o755)
    plan = make_dry_run(f"PYTHON={other}")
    assert "rm -rf .venv" in plan
    assert f"{other} -m venv .venv" in plan
