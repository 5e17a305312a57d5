"""The Grafana dashboards and Prometheus alert rules in deploy/, proven against a router.

Structure first: each dashboard is checked for what Grafana 10+ needs to import it (keys and
types, unique panel ids, panels on the 24-column grid, data sources that resolve), and
promtool checks the rules and the Prometheus configuration.

Then the queries themselves. A router with two agents on the simulator (and a third
simulator standing in for OpenAI) serves a short, varied load: answers and streams, a
rate-limited tenant, a tenant out of daily tokens, an unknown model, failures that walk the
policy's fallback steps down to the provider and past it, an admission refusal, a failed
save of the daily token totals and a failed policy reload. A real Prometheus scrapes it
every second with deploy/prometheus's configuration and rules. Every PromQL expression of
the Prometheus dashboards (Grafana's variables substituted) and the value of every alert
rule must then return at least one series: a renamed metric, a wrong label or a typo would
otherwise leave a panel that is always empty or an alert that can never fire.
docs/dashboards.md explains the rules.

The agents see one GPU through a stand-in for NVIDIA's NVML binding (this machine has none),
so the GPU panels are evaluated too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import yaml

from tests.procs import Cluster, Router, Sim, cluster, free_port, metric, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
# File -> the data source type its panels use.
BOARDS = {
    "hivenet-router.json": "prometheus",
    "hivenet-tenant-quota.json": "prometheus",
    "hivenet-audit.json": "loki",
}

MODEL = "dash-model"
ACME, RPM, TINY, PER_MODEL = "sk-dash-acme", "sk-dash-rpm", "sk-dash-tiny", "sk-dash-model"

# -- structure ------------------------------------------------------------------------------

PANEL_TYPES = {
    "row", "stat", "timeseries", "table", "piechart", "bargauge", "gauge", "logs", "text",
    "barchart", "heatmap", "state-timeline", "histogram",
}  # fmt: skip
VARIABLE_TYPES = {"datasource", "query", "custom", "textbox", "constant", "interval"}
# Grafana's own variables the expressions may use, with the values the test gives them.
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


def load_board(name: str) -> dict[str, Any]:
    board: dict[str, Any] = json.loads((DASHBOARDS / name).read_text())
    return board


def provisioned_datasources() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROVISIONING / "datasources" / "datasources.yaml").read_text())
    assert doc["apiVersion"] == 1
    sources: list[dict[str, Any]] = doc["datasources"]
    return sources


def all_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    found: list[dict[str, Any]] = []
    for panel in board["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def variables(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in board["templating"]["list"]}


def resolve_datasource(ref: object, board: dict[str, Any], kind: str) -> str | None:
    """Why `ref` does not lead Grafana to a data source of type `kind`; None when it does."""
    if not isinstance(ref, dict) or ref.get("type") != kind or not isinstance(ref.get("uid"), str):
        return f"datasource must be {{type: {kind}, uid: ...}}, not {ref!r}"
    uid = ref["uid"]
    named = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", uid)
    if named:
        var = variables(board).get(named.group(1) or named.group(2))
        if var is None or var["type"] != "datasource" or var.get("query") != kind:
            return f"{uid} is not a {kind} datasource variable"
        return None
    if not any(s["uid"] == uid and s["type"] == kind for s in provisioned_datasources()):
        return f"uid {uid} is neither a variable nor a provisioned {kind} data source"
    return None


def grid_problems(panels: list[dict[str, Any]]) -> list[str]:
    problems = []
    cells: dict[tuple[int, int], int] = {}
    for panel in panels:
        pos = panel.get("gridPos")
        keys = ("h", "w", "x", "y")
        if not isinstance(pos, dict) or not all(type(pos.get(k)) is int for k in keys):
            problems.append(f"panel {panel.get('id')}: gridPos needs integer h, w, x, y")
            continue
        h, w, x, y = (pos[k] for k in keys)
        if not (h >= 1 and 1 <= w <= 24 and x >= 0 and x + w <= 24 and y >= 0):
            problems.append(f"panel {panel['id']}: gridPos {pos} is off the 24-column grid")
            continue
        for cell in ((cx, cy) for cx in range(x, x + w) for cy in range(y, y + h)):
            if cell in cells:
                problems.append(f"panel {panel['id']} overlaps panel {cells[cell]}")
                break
            cells[cell] = panel["id"]
    return problems


def variable_problems(board: dict[str, Any]) -> list[str]:
    problems = []
    names = [v.get("name") for v in board["templating"]["list"]]
    if len(names) != len(set(names)):
        problems.append(f"variable names repeat: {names}")
    for var in board["templating"]["list"]:
        if var.get("type") not in VARIABLE_TYPES or not isinstance(var.get("name"), str):
            problems.append(f"variable {var.get('name')}: bad type {var.get('type')}")
        if var.get("type") == "query":
            query = var.get("query")
            text = query.get("query") if isinstance(query, dict) else query
            if not isinstance(text, str) or not text:
                problems.append(f"variable {var['name']}: no query")
            kind = var.get("datasource", {}).get("type")
            why = resolve_datasource(var.get("datasource"), board, str(kind))
            if why:
                problems.append(f"variable {var['name']}: {why}")
    if not any(v.get("type") == "datasource" for v in board["templating"]["list"]):
        problems.append("no datasource variable")
    return problems


def expression_problems(board: dict[str, Any], where: str, expr: str) -> list[str]:
    problems = []
    defined = variables(board)
    for match in VARIABLE.finditer(expr):
        name = match.group(1) or match.group(2)
        var = defined.get(name)
        if var is None and name not in BUILTINS:
            problems.append(f"{where}: ${name} is not defined")
        elif var is not None and (var.get("multi") or var.get("includeAll")):
            # A multi-value variable expands to a regex: only =~ matches it as meant.
            before = expr[: match.start()].rstrip('"').rstrip()
            if not before.endswith("=~"):
                problems.append(f"{where}: multi-value ${name} must be used with =~")
    depth = 0
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth < 0:
            break
    if depth != 0:
        problems.append(f"{where}: unbalanced brackets in {expr!r}")
    return problems


def panel_problems(board: dict[str, Any], panel: dict[str, Any], kind: str) -> list[str]:
    where = f"panel {panel.get('id')} ({panel.get('title')})"
    problems = []
    if panel.get("type") not in PANEL_TYPES or not isinstance(panel.get("title"), str):
        problems.append(f"{where}: unknown type {panel.get('type')} or no title")
    if panel.get("type") == "row":
        if not isinstance(panel.get("panels"), list) or panel["gridPos"].get("w") != 24:
            problems.append(f"{where}: a row needs a panels list and the full width")
        return problems
    why = resolve_datasource(panel.get("datasource"), board, kind)
    if why:
        problems.append(f"{where}: {why}")
    if not isinstance(panel.get("fieldConfig", {}).get("defaults"), dict):
        problems.append(f"{where}: fieldConfig.defaults missing")
    targets = panel.get("targets")
    if not isinstance(targets, list) or not targets:
        return [*problems, f"{where}: no targets"]
    ref_ids = [t.get("refId") for t in targets]
    if len(set(ref_ids)) != len(ref_ids) or not all(isinstance(r, str) and r for r in ref_ids):
        problems.append(f"{where}: refIds must be distinct strings: {ref_ids}")
    for target in targets:
        expr = target.get("expr")
        if not isinstance(expr, str) or not expr.strip():
            problems.append(f"{where}: target {target.get('refId')} has no expr")
            continue
        if "datasource" in target:
            why = resolve_datasource(target["datasource"], board, kind)
            problems.extend([f"{where}: target {target['refId']}: {why}"] if why else [])
        problems.extend(expression_problems(board, f"{where} {target['refId']}", expr))
        if kind == "loki" and not re.search(
            r'\{job="hivenet-router", log_type="audit"\} \| json', expr
        ):
            problems.append(f"{where}: LogQL must select the audit stream and parse it")
    return problems


def board_problems(name: str) -> list[str]:
    board = load_board(name)
    kind = BOARDS[name]
    problems = []
    required = {
        "uid": str, "title": str, "schemaVersion": int, "panels": list, "templating": dict,
        "time": dict, "tags": list, "editable": bool, "version": int, "annotations": dict,
    }  # fmt: skip
    for key, kind_of in required.items():
        if not isinstance(board.get(key), kind_of):
            return [f"{key} must be a {kind_of.__name__}"]
    if not UID.match(board["uid"]):
        problems.append(f"uid {board['uid']!r} is not a Grafana uid")
    if board["schemaVersion"] < 38:  # Grafana 10.0 writes 38
        problems.append(f"schemaVersion {board['schemaVersion']} predates Grafana 10")
    if board.get("id") is not None:
        problems.append("id must be null: Grafana assigns it on import")
    panels = all_panels(board)
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)) or not all(type(i) is int for i in ids):
        problems.append(f"panel ids must be distinct integers: {ids}")
    problems += grid_problems(panels)
    problems += variable_problems(board)
    for panel in panels:
        problems += panel_problems(board, panel, kind)
    return problems


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_dashboard_imports_into_grafana(name: str) -> None:
    assert board_problems(name) == []


def test_dashboards_have_distinct_uids_and_titles() -> None:
    boards = [load_board(name) for name in BOARDS]
    assert len({b["uid"] for b in boards}) == len(boards)
    assert len({b["title"] for b in boards}) == len(boards)
    # The reference's URLs (/d/UID/) keep working.
    assert {b["uid"] for b in boards} == {
        "hivenet-router",
        "hivenet-router-tenants",
        "hivenet-router-audit",
    }


def test_provisioning_files_match_the_dashboards() -> None:
    sources = provisioned_datasources()
    for source in sources:
        assert {"name", "uid", "type", "url", "access"} <= set(source), source
    assert len({s["uid"] for s in sources}) == len(sources)
    assert [s["type"] for s in sources if s.get("isDefault")] == ["prometheus"]
    # Each dashboard's datasource variable has a data source to pick.
    assert set(BOARDS.values()) <= {s["type"] for s in sources}
    doc = yaml.safe_load((PROVISIONING / "dashboards" / "dashboards.yaml").read_text())
    assert doc["apiVersion"] == 1
    [provider] = doc["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


# -- alert rules ----------------------------------------------------------------------------

COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)\s*(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)")
SEVERITIES = {"critical", "warning", "info"}


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def top_level(expr: str) -> str:
    """`expr` with quoted strings and everything inside brackets removed."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    out, depth = [], 0
    for char in text:
        depth -= char in ")]}"
        if depth == 0:
            out.append(char)
        depth += char in "([{"
    return "".join(out)


def split_alert(expr: str) -> tuple[str, str]:
    """(value, comparison): the last line is the comparison with a number; the value must
    not have a set operator or a comparison outside brackets, or the comparison would bind
    to only part of it."""
    *value_lines, last = expr.strip().splitlines()
    assert COMPARISON.fullmatch(last.strip()), f"last line is not a comparison: {last!r}"
    value = "\n".join(value_lines)
    outside = top_level(value)
    assert not re.search(r"\b(and|or|unless)\b|==|!=|>=|<=|>|<", outside), (
        f"wrap the value in parentheses: {value!r}"
    )
    return value, last.strip()


def test_every_alert_rule_is_complete() -> None:
    rules = alert_rules()
    assert len(rules) >= 20
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for"))), rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        split_alert(rule["expr"])


# -- live: a router, its load and Prometheus ------------------------------------------------


def prometheus_binaries() -> tuple[str, str]:
    """prometheus and promtool, or a skip (a failure under CI) when they are missing."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if found[0] and found[1]:
        return found[0], found[1]
    reason = "prometheus/promtool not installed (scripts/prometheus.sh installs them)"
    if os.environ.get("CI"):
        pytest.fail(reason + "; CI is set, so this is a failure")
    pytest.skip(reason)


def promtool(*args: str) -> None:
    tool = prometheus_binaries()[1]
    done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_rules() -> None:
    promtool("check", "rules", str(ALERTS))


FAKE_NVML = '''\
"""Stands in for NVIDIA's NVML binding in tests: one GPU with fixed readings."""
NVML_TEMPERATURE_GPU = 0


class _Memory:
    total = 80 * 2**30
    used = 30 * 2**30
    free = total - used


class _Utilization:
    gpu = 42
    memory = 30


def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(index): return index
def nvmlDeviceGetUUID(handle): return "GPU-00000000-fake-%d" % handle
def nvmlDeviceGetName(handle): return "Fake GPU"
def nvmlDeviceGetMemoryInfo(handle): return _Memory()
def nvmlDeviceGetUtilizationRates(handle): return _Utilization()
def nvmlDeviceGetTemperature(handle, sensor): return 61
def nvmlDeviceGetPowerUsage(handle): return 275000
'''

POLICY = f"""\
models: [{MODEL}]
routing_policy:
  match: {{region: eu}}
  strategy: least-loaded
  max_tries: 1
fallback_chain:
  - name: any-region
    strategy: least-loaded
    max_tries: 1
fallback_provider:
  engine: openai
  model: cloud-model
admit_budget_tokens: 600
max_inflight: 64
"""


def key_entry(raw: str, owner: str, quota: str) -> str:
    digest = hashlib.sha256(raw.encode()).hexdigest()
    return (
        f'    - key_hash: "{digest}"\n'
        f"      metadata: {{name: {owner}, owner: {owner}}}\n"
        f"      quota: {quota}\n"
    )


def write_auth(path: Path) -> Path:
    path.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        + key_entry(ACME, "acme", "{requests_per_minute: 6000, tokens_per_day: 1000000}")
        + key_entry(RPM, "rpm-tenant", "{requests_per_minute: 2}")
        + key_entry(TINY, "tiny-tenant", "{tokens_per_day: 60}")
        + key_entry(
            PER_MODEL,
            "model-tenant",
            "{per_model: {" + MODEL + ": {requests_per_minute_per_replica: 100, "
            "tokens_per_day: 100000}}}",
        )
        + "admin:\n  mode: api-key\n"
    )
    return path


@dataclass
class Live:
    router: Router
    prometheus: str  # its base URL
    started: float  # when Prometheus started (wall clock)
    config: Path  # its configuration, pointed at the router


def start_fleet(c: Cluster, tmp: Path) -> tuple[Router, list[Sim]]:
    """Router with a provider fallback, two agents (eu and us) with one fake GPU each; the
    simulators are returned in the order cloud (the provider), a, b."""
    policies = tmp / "policies"
    policies.mkdir()
    (policies / f"{MODEL}.yaml").write_text(POLICY)
    cloud = c.sim("cloud-model", "--zero-latency", name="cloud")
    router = c.router(
        "--auth-config-file",
        str(write_auth(tmp / "auth.yaml")),
        "--policy-model-dir",
        str(policies),
        "--universal-flush-interval",
        "1s",  # daily token totals are saved this often
        env={
            "HIVENET_ROUTER_QUOTA_BACKEND": "badger",
            "HIVENET_ROUTER_OPENAI_API_KEY": "sk-cloud",
            "HIVENET_ROUTER_OPENAI_BASE_URL": cloud.url,
        },
    )
    nvml = tmp / "fake-nvml"
    nvml.mkdir()
    (nvml / "pynvml.py").write_text(FAKE_NVML)
    sims = [cloud]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(nvml))
        for name, region in (("a", "eu"), ("b", "us")):
            sim = c.sim(MODEL, name=f"sim-{name}")
            sims.append(sim)
            c.agent(
                router, sim, "--region", region, "--capacity", "2",
                "--deployment-id", f"dep-{name}", "--organization", f"org-{name}",
                "--machine", f"host-{name}", "--hardware-sample-interval", "300ms",
                name=f"agent-{name}",
            )  # fmt: skip

    def ready() -> bool:
        text = router.metrics()
        return (
            all(
                metric(text, family, machine=f"host-{name}") is not None
                for family in (
                    "hivenet_agent_gpu_utilization_percent",
                    "hivenet_agent_engine_kv_cache_utilization",
                )
                for name in "ab"
            )
            and metric(text, "hivenet_routing_agent_healthy") == 2.0
        )

    wait_until(ready, timeout=30)
    return router, sims


def start_prometheus(c: Cluster, tmp: Path, router: Router) -> tuple[str, Path]:
    """Prometheus with deploy/prometheus's configuration, scraping `router` every second."""
    binary = prometheus_binaries()[0]
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    [job] = config["scrape_configs"]
    assert job["job_name"] == "hivenet-router"  # the name HivenetRouterDown selects
    job["static_configs"] = [{"targets": [f"127.0.0.1:{router.metrics_port}"]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    c.spawn(
        "prometheus",
        [
            binary,
            f"--config.file={path}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/-/ready", timeout=1).status_code == 200, timeout=30)
    return url, path


def chat(key: str, max_tokens: int = 8, model: str = MODEL) -> dict[str, Any]:
    return {
        "json": {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me about routers."}],
            "max_tokens": max_tokens,
        },
        "headers": {"Authorization": f"Bearer {key}"},
    }


def long_stream(router: Router, max_tokens: int) -> None:
    """An SDK stream long enough (about 2 s) to be in flight during a scrape."""
    with router.openai(ACME) as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Stream a long answer."}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert any(chunk.usage is not None for chunk in stream)


def statuses(http: httpx.Client, key: str, count: int, max_tokens: int = 8) -> list[int]:
    return [
        http.post("/v1/chat/completions", **chat(key, max_tokens)).status_code for _ in range(count)
    ]


def admission_refusal(router: Router, http: httpx.Client) -> None:
    """While a stream holds part of the model's occupancy budget (600 x 0.9 x 2 replicas =
    1080 tokens), a request declaring 1050 output tokens does not fit: it parks, then gets
    b2's 429. (The burst and streams of `load` stay well under the budget.)"""
    with router.openai(ACME) as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hold the pool."}],
            max_tokens=100,
            stream=True,
        )
        next(iter(stream))
        refused = http.post("/v1/chat/completions", **chat(ACME, 1050))
        assert refused.status_code == 429, refused.text
        for _chunk in stream:
            pass


def failures(http: httpx.Client, sims: list[Sim]) -> None:
    """Agent a fails (fallback step), then b too (provider answers), then the provider too."""
    cloud, sim_a, sim_b = sims
    try:
        sim_a.set_faults(error_rate=1.0)
        assert statuses(http, ACME, 2) == [200, 200]  # agent b, in the fallback step
        sim_b.set_faults(error_rate=1.0)
        assert statuses(http, ACME, 2) == [200, 200]  # the provider
        cloud.set_faults(error_rate=1.0)
        assert statuses(http, ACME, 1) == [502]
    finally:
        for sim in sims:
            sim.set_faults(error_rate=0.0)


def failed_reload(router: Router, policies: Path) -> None:
    """A policy directory that went missing: the reload is refused, the policies stay."""
    assert router.proc.popen is not None
    aside = policies.with_name("policies-aside")
    policies.rename(aside)
    try:
        router.proc.popen.send_signal(signal.SIGHUP)
        wait_until(
            lambda: metric(router.metrics(), "hivenet_policy_reload_total", result="error") == 1.0
        )
    finally:
        aside.rename(policies)
    router.proc.popen.send_signal(signal.SIGHUP)
    wait_until(
        lambda: metric(router.metrics(), "hivenet_policy_reload_total", result="success") == 1.0
    )


def lock_quota_store(store: Path) -> Callable[[Router], None]:
    """Another process takes the store's write lock: saving the daily token totals fails
    (after SQLite's 5 s busy wait) and the router counts a quota persistence error. The
    returned function waits for that error, then lets go."""
    db = sqlite3.connect(store, isolation_level=None, check_same_thread=False)
    db.execute("BEGIN EXCLUSIVE")

    def release_after_error(router: Router) -> None:
        try:
            wait_until(
                lambda: metric(router.metrics(), "hivenet_quota_backend_errors_total"),
                timeout=20,
                interval=0.2,
            )
        finally:
            db.execute("ROLLBACK")
            db.close()

    return release_after_error


def load(router: Router, sims: list[Sim], tmp: Path) -> None:
    release = lock_quota_store(tmp / "router-store" / "hivenet.sqlite3")
    with ThreadPoolExecutor(max_workers=3) as background:
        waits = [background.submit(release, router)]
        waits += [background.submit(long_stream, router, 150) for _ in range(2)]
        with httpx.Client(base_url=router.url, timeout=30) as http:
            with ThreadPoolExecutor(max_workers=12) as pool:  # more than the 4 slots: queueing
                burst = list(pool.map(lambda _: statuses(http, ACME, 1, 16)[0], range(24)))
            assert burst == [200] * 24
            assert statuses(http, RPM, 4) == [200, 200, 429, 429]
            assert statuses(http, TINY, 1) == [200]
            assert statuses(http, TINY, 2, max_tokens=100) == [429, 429]  # out of daily tokens
            assert statuses(http, PER_MODEL, 2) == [200, 200]
            unknown = http.post("/v1/chat/completions", **chat(ACME, model="no-such-model"))
            assert unknown.status_code == 404
            failures(http, sims)
            admission_refusal(router, http)
        failed_reload(router, tmp / "policies")
        for done in waits:
            done.result(timeout=30)  # re-raises what failed in the background
    # Stat panels rate over the last minute; everything above can take longer than that
    # on a slow machine, so the load ends with fresh tokens for the quota tenant.
    with httpx.Client(base_url=router.url, timeout=30) as http:
        assert statuses(http, ACME, 2) == [200, 200]


def query(live: Live, expr: str, *, instant: bool) -> tuple[str | None, int]:
    """(error, series): an instant query now, or a range query over the whole test."""
    now = time.time()
    if instant:
        path, params = "/api/v1/query", {"query": expr, "time": f"{now:.3f}"}
    else:
        params = {"query": expr, "start": f"{live.started:.3f}", "end": f"{now:.3f}", "step": "1"}
        path = "/api/v1/query_range"
    reply = httpx.post(live.prometheus + path, data=params, timeout=30)
    body = reply.json()
    if body.get("status") != "success":
        return f"{body.get('errorType')}: {body.get('error')}", 0
    data = body["data"]
    return None, 1 if data["resultType"] == "scalar" else len(data["result"])


def scraped_since(live: Live, moment: float, scrapes: int) -> bool:
    reply = httpx.post(
        live.prometheus + "/api/v1/query",
        data={"query": 'timestamp(up{job="hivenet-router"} == 1)'},
        timeout=5,
    ).json()
    results = reply["data"]["result"]
    return bool(results) and float(results[0]["value"][1]) >= moment + scrapes


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    prometheus_binaries()
    tmp: Path = tmp_path_factory.mktemp("dashboards")
    with cluster(tmp) as c:
        router, sims = start_fleet(c, tmp)
        started = time.time()
        url, config = start_prometheus(c, tmp, router)
        state = Live(router, url, started, config)
        load(router, sims, tmp)
        # Every series the load created has a few samples before anything is evaluated.
        done = time.time()
        wait_until(lambda: scraped_since(state, done, 3), timeout=30, interval=0.25)
        yield state


def prometheus_targets() -> list[tuple[str, str, str, bool]]:
    """(dashboard, panel title, expr, instant) for every Prometheus target."""
    found = []
    for name, kind in BOARDS.items():
        if kind != "prometheus":
            continue
        board = load_board(name)
        for panel in all_panels(board):
            for target in panel.get("targets", []):
                found.append((name, panel["title"], target["expr"], bool(target.get("instant"))))
    return found


def substitute(board: dict[str, Any], expr: str) -> str:
    """Grafana's rendering of `expr` with every multi-value variable at All (`.*`)."""
    defined = variables(board)

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        var = defined[name]
        if var.get("includeAll"):
            return str(var.get("allValue") or ".*")
        return str(var["current"]["value"])

    return VARIABLE.sub(value, expr)


def test_promtool_accepts_the_configuration(live: Live) -> None:
    promtool("check", "config", str(live.config))


def test_every_dashboard_expression_returns_series(live: Live) -> None:
    empty, evaluated = [], 0
    for name, title, expr, instant in prometheus_targets():
        rendered = substitute(load_board(name), expr)
        error, count = query(live, rendered, instant=instant)
        evaluated += 1
        if error or count == 0:
            empty.append(f"{name} / {title}: {error or 'no series'}: {rendered}")
    assert not empty, "\n".join(empty)
    assert evaluated >= 80


def test_every_variable_lists_values(live: Live) -> None:
    empty = []
    for name, kind in BOARDS.items():
        board = load_board(name)
        for var in board["templating"]["list"]:
            if var["type"] != "query" or kind != "prometheus":
                continue
            text = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", text)
            assert match, text
            selector = substitute(board, match.group(1))
            reply = httpx.post(
                live.prometheus + "/api/v1/query", data={"query": selector}, timeout=10
            ).json()
            values = {r["metric"].get(match.group(2)) for r in reply["data"]["result"]}
            if not values - {None, ""}:
                empty.append(f"{name} ${var['name']}: {text}")
    assert not empty, "\n".join(empty)


def test_every_alert_value_returns_series(live: Live) -> None:
    empty = []
    for rule in alert_rules():
        value, _comparison = split_alert(rule["expr"])
        error, count = query(live, value, instant=True)
        if error or count == 0:
            empty.append(f"{rule['alert']}: {error or 'no series'}: {value}")
        error, _count = query(live, rule["expr"], instant=True)
        if error:
            empty.append(f"{rule['alert']} (whole expr): {error}")
    assert not empty, "\n".join(empty)


def test_prometheus_evaluates_every_rule_cleanly(live: Live) -> None:
    def rules() -> list[dict[str, Any]]:
        reply = httpx.get(live.prometheus + "/api/v1/rules", timeout=5).json()
        return [r for g in reply["data"]["groups"] for r in g["rules"]]

    wait_until(lambda: all(r["health"] != "unknown" for r in rules()), timeout=20)
    loaded = rules()
    assert len(loaded) == len(alert_rules())
    assert [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []
