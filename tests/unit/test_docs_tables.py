"""The operator docs' hand-written tables, kept in step with the code.

The option tables are generated (scripts/gen_config_docs.py --check, in `make lint`) and the
metrics' names, types and labels are checked against the reference on a live scrape
(tests/integration/test_metrics.py). What is left: every client error code is in
docs/api.md's table with its status, and every metric the code defines is in
docs/observability.md (the engine simulator's in docs/simulator.md), and no page names a
metric the code no longer has.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

from hivenet_router.domain.errors import STATUS, ErrorCode

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "hivenet_router"
REFERENCE = ROOT / "tests" / "data" / "reference_metrics.json"
METRIC = re.compile(r"(?:hivenet|http)_[a-z0-9]+_[a-z0-9_]+|vllm:[a-z0-9_]+")


def error_rows() -> list[tuple[str, int]]:
    """(code, status) of each row of api.md's table of error codes."""
    text = (DOCS / "api.md").read_text()
    table = text[text.index("| Code | Status | When |") :].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \|", table, re.M)
    return [(code, int(status)) for code, status in rows]


def test_every_error_code_is_in_the_api_table_with_its_status() -> None:
    rows = error_rows()
    documented = {code for code, _ in rows}
    assert sorted(documented - {c.value for c in ErrorCode}) == []  # no code the code lacks
    assert sorted({c.value for c in ErrorCode} - documented) == []  # no code left out
    for code in ErrorCode:
        # A code may have more than one row (413 and 431; 408 and 504); one is its own.
        assert STATUS[code] in {status for name, status in rows if name == code.value}, code


def metric_literals(folder: Path) -> Iterator[str]:
    """Metric names written as string constants in the code (the families built from
    f-strings, the agent's host and engine gauges, are the reference's: test_metrics.py)."""
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and METRIC.fullmatch(value):
                yield value


def bare(name: str) -> str:
    return name.removesuffix("_total")


def documented(names: set[str], doc: Path) -> list[str]:
    """The names `doc` does not mention: in full, under a family wildcard (`hivenet_sync_*`)
    or as a suffix after a full name on the same line (`hivenet_routing_agent_info`,
    `_healthy`)."""
    missing = []
    lines = [
        [token.split("{", 1)[0] for token in re.findall(r"`([^`\s]+)`", line)]
        for line in doc.read_text().splitlines()
    ]
    full = {bare(token) for tokens in lines for token in tokens}
    wildcards = [t[:-1] for tokens in lines for t in tokens if re.fullmatch(r"[a-z]+_\w+_\*", t)]
    for name in sorted(names):
        if bare(name) in full or any(name.startswith(w) for w in wildcards):
            continue
        if not any(abbreviates(tokens, bare(name)) for tokens in lines):
            missing.append(name)
    return missing


def abbreviates(tokens: list[str], name: str) -> bool:
    for n, token in enumerate(tokens):
        if not token.startswith("_"):
            continue
        for earlier in tokens[:n]:
            cuts = [m.start() for m in re.finditer("_", earlier)]
            if any(earlier[:cut] + bare(token) == name for cut in cuts):
                return True
    return False


def test_every_metric_of_the_router_is_in_observability_md() -> None:
    # The agent reads engines' vllm:* names; the router exports none of them.
    code = {n for n in metric_literals(SRC) if not n.startswith("vllm:")}
    code -= set(metric_literals(SRC / "sim"))
    assert len(code) > 60  # the scan found the collectors
    assert documented(code, DOCS / "observability.md") == []


def test_every_metric_of_the_simulator_is_in_simulator_md() -> None:
    code = set(metric_literals(SRC / "sim"))
    assert "vllm:num_requests_running" in code
    assert documented(code, DOCS / "simulator.md") == []


def test_no_page_names_a_metric_the_router_lacks() -> None:
    known = {bare(n) for n in metric_literals(SRC)}
    known |= {bare(m["name"]) for m in json.loads(REFERENCE.read_text())["metrics"]}
    stale = []
    for doc in sorted(DOCS.glob("*.md")):
        tokens = (t.split("{", 1)[0] for t in re.findall(r"`([^`\s*]+)`", doc.read_text()))
        named = {bare(t) for t in tokens if METRIC.fullmatch(t) and not t.startswith("vllm:")}
        stale += [f"{doc.name}: {name}" for name in sorted(named - known)]
    assert stale == []
