"""Write the option tables of docs/configuration.md from the option declarations.

`--check` fails when the file differs from what the declarations say.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from hivenet_router.config.agent import AgentConfig
from hivenet_router.config.options import markdown_table
from hivenet_router.config.router import RouterConfig
from hivenet_router.config.sim import SimConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
TABLES = {"router": RouterConfig, "agent": AgentConfig, "sim": SimConfig}


def render(text: str) -> str:
    for name, config in TABLES.items():
        pattern = re.compile(
            rf"(<!-- options:{name} -->\n)(?:.*?\n)?(<!-- /options:{name} -->)", re.DOTALL
        )
        if not pattern.search(text):
            raise SystemExit(f"{DOC} lacks the markers for the {name} table")
        table = markdown_table(config)
        text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
    return text


def main() -> int:
    current = DOC.read_text()
    wanted = render(current)
    if "--check" in sys.argv:
        if current != wanted:
            print(f"{DOC} is out of date with the option declarations: run `make docs`")
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
