"""Fail when a function in src/ is longer than MAX_LINES: long functions hide the steps a
reader must follow (the router's serve function once had 205 lines)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_LINES = 90
ROOT = Path(__file__).resolve().parents[1] / "src"


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_LINES:
                    where = path.relative_to(root.parent)
                    found.append(f"{where}:{node.lineno}: {node.name} has {length} lines")
    return found


def main() -> int:
    found = long_functions(ROOT)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} function(s) over {MAX_LINES} lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
