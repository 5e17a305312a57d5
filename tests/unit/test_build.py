"""The build's choice of interpreter: scripts/python.sh and the Makefile's .venv rule."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def make_dry_run(python: str) -> str:
    """What `make` would run for the venv with this interpreter, without running it. The
    flags of a `make` this test runs under (`-B` would plan every rule) stay out."""
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHON")
    env = {name: value for name, value in os.environ.items() if name not in outer}
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), ".venv/.installed", f"PYTHON={python}"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return done.stdout


def venv_interpreter() -> str:
    """The interpreter .venv was made from, as the venv itself records it."""
    for line in (ROOT / ".venv" / "pyvenv.cfg").read_text().splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "executable":
            return value.strip()
    raise AssertionError(".venv/pyvenv.cfg names no executable")


def test_the_chosen_interpreter_is_python_3_11_with_venv_and_pip() -> None:
    if "PYTHON" in os.environ:
        pytest.skip("PYTHON names the interpreter here: scripts/python.sh is not asked")
    chosen = subprocess.run(
        [str(ROOT / "scripts" / "python.sh")], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert chosen
    check = "import sys, ensurepip, pip; print(sys.version_info[:2])"
    done = subprocess.run([chosen, "-c", check], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "(3, 11)"


def test_the_venv_is_kept_while_its_interpreter_stays() -> None:
    assert (ROOT / ".venv" / "bin" / "python").exists()
    assert "rm -rf .venv" not in make_dry_run(venv_interpreter())


def test_another_interpreter_rebuilds_the_venv(tmp_path: Path) -> None:
    other = tmp_path / "python3.11"
    other.write_text("#!/bin/sh\nexit 0\n")
    other.chmod(0o755)
    plan = make_dry_run(str(other))
    assert "rm -rf .venv" in plan
    assert f"{other} -m venv .venv" in plan
