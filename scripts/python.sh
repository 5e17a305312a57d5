#!/usr/bin/env bash
# Prints the Python 3.11 interpreter that `make` builds .venv with (PYTHON=... overrides).
#
# The interpreter's build decides much of the router's speed. The distribution's CPython
# (Debian's /usr/bin/python3.11: profile-guided and link-time optimized, libpython linked
# into the executable) ran the router with 12 to 20% less CPU per JSON request, and the
# agents and streams with 3 to 19% less, than a default pyenv build of 3.11.7 (no PGO or
# LTO, libpython as a shared library) on the same machine; see "Which Python" in
# docs/benchmarks.md. So the distribution's build comes first, when it can make a virtual
# environment and has pip; otherwise the first python3.11 on PATH. A venv's interpreter is
# named by what it links to (with .venv activated, python3.11 is .venv's own, which a
# rebuild of .venv deletes).
set -euo pipefail

usable() {
    [[ -x "$1" ]] && "$1" -c '
import sys
import ensurepip, pip  # Debian ships both in packages of their own (python3.11-venv, python3-pip)
sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1
}

for candidate in /usr/bin/python3.11 "$(command -v python3.11 || true)"; do
    if [[ -n "$candidate" ]] && usable "$candidate"; then
        readlink -f "$candidate"
        exit 0
    fi
done
# Nothing usable found: name the interpreter, and let `make` say that it is missing.
echo python3.11
