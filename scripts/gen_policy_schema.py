"""Write docs/policy.schema.json from the loader's tables and the blocks the router hands
its policy store (router/wiring.py); `--check` fails when it drifts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hivenet_router.policy.schema import policy_schema
from hivenet_router.router.wiring import POLICY_BLOCKS

OUT = Path(__file__).resolve().parent.parent / "docs" / "policy.schema.json"


def main() -> int:
    text = json.dumps(policy_schema(POLICY_BLOCKS), indent=2) + "\n"
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run `make docs`")
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
