"""Wallets through real processes: routers with --ledger-dsn on one real PostgreSQL, the
simulator behind agents, the OpenAI SDK with a key per tenant (docs/wallets.md)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx2 as httpx
import openai
import pytest

from tests.postgres import Postgres, postgres_server
from tests.procs import ADMIN_KEY, Cluster, Router, metric, wait_until

MODEL = "m"
PRICES = "prices: {input_per_million: 1000, output_per_million: 2000}\n"  # 0.001, 0.002
PROMPT = [{"role": "user", "content": "Say hi."}]
MAX_TOKENS = 8
# The most one request can cost: every prompt byte a token, plus the declared output.
WORST = (Decimal(len("Say hi.")) + 4) * Decimal("0.001") + MAX_TOKENS * Decimal("0.002")


@pytest.fixture
def pg() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


def key(tenant: str) -> str:
    return f"sk-wallet-{tenant}-0123456789"


def files(tmp: Path, tenants: list[str]) -> list[str]:
    auth = tmp / "auth.yaml"
    entries = "".join(
        f'    - key_hash: "{hashlib.sha256(key(t).encode()).hexdigest()}"\n'
        f"      metadata: {{name: k-{t}, owner: {t}}}\n"
        for t in tenants
    )
    auth.write_text(f"api:\n  mode: api-key\n  keys:\n{entries}admin:\n  mode: api-key\n")
    policy = tmp / "policy.yaml"
    policy.write_text(PRICES + "routing_policy: {strategy: least-loaded}\n")
    return ["--auth-config-file", str(auth), "--policy-file", str(policy)]


def start(
    cluster: Cluster,
    tmp: Path,
    dsn: str,
    tenants: list[str],
    name: str = "router",
    ports: Router | None = None,
    up: bool = True,
) -> Router:
    router = cluster.router(
        "--ledger-dsn", dsn, "--ledger-timeout", "500ms", *files(tmp, tenants),
        name=name, ports=ports,
    )  # fmt: skip
    if up:
        wait_until(lambda: ledger_up(router), timeout=10)
    return router


def serving(cluster: Cluster, routers: list[Router]) -> None:
    sim = cluster.sim(MODEL, "--zero-latency")
    for n, router in enumerate(routers):
        cluster.agent(router, sim, name=f"agent{n}")
    for router in routers:  # /v1/models needs a key here: read the metric instead
        wait_until(lambda r=router: metric(r.metrics(), "hivenet_routing_agent_healthy") == 1.0)


def ledger_up(router: Router) -> bool:
    return metric(router.metrics(), "hivenet_ledger_up") == 1.0


def admin(router: Router, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(
        method,
        router.url + path,
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )


def credit(router: Router, tenant: str, amount: str) -> dict[str, Any]:
    answer = admin(router, "POST", f"/admin/wallets/{tenant}/credit", {"amount": amount})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def ask(client: openai.OpenAI) -> bool:
    """One request: True when served, False when refused for its balance."""
    try:
        client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS)
    except openai.APIStatusError as exc:
        assert exc.status_code == 402, exc
        return False
    return True


def charges(pg: Postgres, tenant: str | None = None) -> int:
    where = f" AND tenant = '{tenant}'" if tenant else ""
    return int(pg.psql(f"SELECT count(*) FROM ledger WHERE kind = 'charge'{where}"))  # noqa: S608


def reconciled(router: Router) -> dict[str, Any]:
    answer = admin(router, "GET", "/admin/ledger/reconcile")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def test_an_unfunded_tenant_gets_402_until_credited(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    router = start(make_cluster, tmp_path, pg.dsn(), ["acme"])
    serving(make_cluster, [router])
    with router.openai(key("acme")) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS)
        assert refused.value.status_code == 402
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "insufficient_balance"
        assert error["type"] == "billing_error" and "no wallet" in error["message"]
        assert credit(router, "acme", "1.5")["balance"] == "1.5"
        reply = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8)
        assert reply.usage is not None
    cost = Decimal(reply.usage.prompt_tokens) * Decimal("0.001") + Decimal(
        reply.usage.completion_tokens
    ) * Decimal("0.002")
    wait_until(lambda: charges(pg, "acme") == 1, timeout=5)
    wallet = admin(router, "GET", "/admin/wallets/acme").json()
    assert Decimal(wallet["balance"]) == Decimal("1.5") - cost and Decimal(wallet["held"]) == 0
    page = admin(router, "GET", "/admin/wallets/acme/ledger?limit=1").json()
    assert [e["kind"] for e in page["entries"]] == ["charge"] and page["next_before"]
    assert reconciled(router)["ok"]
    assert metric(router.metrics(), "hivenet_wallet_refused_total", reason="no_wallet") >= 1


def test_two_routers_one_database_a_thousand_requests_reconcile(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    tenants = [f"t{n:02d}" for n in range(20)]
    routers = [start(make_cluster, tmp_path, pg.dsn(), tenants, name=name) for name in ("ra", "rb")]
    serving(make_cluster, routers)
    poor = tenants[15:]  # enough for a few requests each, then 402
    for tenant in tenants:
        credit(routers[0], tenant, "0.1" if tenant in poor else "100")
    clients = {
        (tenant, n): router.openai(key(tenant))
        for tenant in tenants
        for n, router in enumerate(routers)
    }
    served = dict.fromkeys(tenants, 0)
    lock = threading.Lock()

    def one(i: int) -> None:
        tenant = tenants[i % len(tenants)]
        if ask(clients[(tenant, i % 2)]):
            with lock:
                served[tenant] += 1

    with ThreadPoolExecutor(48) as pool:
        list(pool.map(one, range(1000)))
    total = sum(served.values())
    assert all(served[t] == 50 for t in tenants if t not in poor)  # 1,000 / 20 each
    assert all(1 <= served[t] < 50 for t in poor)  # some, then 402
    wait_until(lambda: charges(pg) == total, timeout=10)  # settles finish in the background
    for tenant in tenants:
        assert charges(pg, tenant) == served[tenant]
    assert reconciled(routers[1]) == {"ok": True, "tenants": 20, "mismatches": []}
    for tenant in poor:
        wallet = admin(routers[1], "GET", f"/admin/wallets/{tenant}").json()
        assert Decimal(wallet["balance"]) >= -WORST and Decimal(wallet["held"]) == 0
    for client in clients.values():
        client.close()


def test_the_database_killed_mid_run_bills_the_unbilled_once_it_returns(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    router = start(make_cluster, tmp_path, pg.dsn(), ["acme"])
    serving(make_cluster, [router])
    credit(router, "acme", "100")
    with router.openai(key("acme")) as client:
        before = sum(ask(client) for _ in range(20))
        wait_until(lambda: charges(pg) == before, timeout=5)
        pg.kill()
        during = sum(ask(client) for _ in range(30))  # fail-open: all served
        assert during == 30
        text = router.metrics()
        assert metric(text, "hivenet_ledger_up") == 0.0
        assert metric(text, "hivenet_wallet_unbilled_total") >= 25
        assert metric(text, "hivenet_wallet_pending_charges") == 30
        pg.start()
        wait_until(lambda: ledger_up(router), timeout=15)
        after = sum(ask(client) for _ in range(10))
    wait_until(lambda: charges(pg) == before + during + after, timeout=15)
    assert metric(router.metrics(), "hivenet_wallet_pending_charges") == 0.0
    assert reconciled(router)["ok"]
    log = router.proc.log()
    assert log.count("ledger unreachable") == 1 and "30 pending charges billed" in log


def test_charges_pending_at_a_restart_are_billed_by_the_next_start(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    router = start(make_cluster, tmp_path, pg.dsn(), ["acme"])
    serving(make_cluster, [router])
    credit(router, "acme", "100")
    pg.kill()
    with router.openai(key("acme")) as client:
        assert sum(ask(client) for _ in range(12)) == 12
    wait_until(lambda: metric(router.metrics(), "hivenet_wallet_pending_charges") == 12)
    router.proc.stop()
    assert "12 unbilled charges kept" in router.proc.log()
    pg.start()
    again = start(make_cluster, tmp_path, pg.dsn(), ["acme"], name="router", ports=router)
    wait_until(lambda: charges(pg) == 12, timeout=10)
    assert metric(again.metrics(), "hivenet_wallet_pending_charges") == 0.0
    assert reconciled(again)["ok"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"amount": -1}, "above zero"),
        ({"amount": 0}, "above zero"),
        ({"amount": "ten"}, "decimal string"),
        ({"amount": "1e3"}, "decimal string"),
        ({"amount": True}, "decimal string"),
        ({"amount": "0.0000000001"}, "at most 9 decimals"),
        ({"amount": 1e16}, "below 10^15"),
        ({"amount": "5", "currency": "XYZ"}, "unknown currency"),
        ({"amount": "5", "currency": "EUR"}, "is in USD, not EUR"),
        ({"amount": "5", "extra": 1}, "unknown field"),
        ({"amount": "5", "note": "invoice\u0000118"}, "without NUL"),
        ({"amount": "5", "note": "x" * 501}, "1 to 500 characters"),
        ({"amount": "5", "reference": ""}, "reference: a string of 1 to 128"),
        ({"amount": "5", "reference": "a\nb"}, "reference: printable"),
        ({}, "amount: required"),
        ([1], "JSON object"),
    ],
)
def test_bad_credits_are_400_with_the_envelope(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres, body: Any, says: str
) -> None:
    router = start(make_cluster, tmp_path, pg.dsn(), ["acme"])
    credit(router, "acme", "1")
    answer = admin(router, "POST", "/admin/wallets/acme/credit", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_parameter" and says in error["message"]
    raw = httpx.post(
        router.url + "/admin/wallets/acme/credit",
        content=b'{"amount": NaN}',
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=5,
    )
    assert raw.status_code == 400
    for huge in (b'{"amount": 1e1000000}', b'{"amount": 1e-1000000}'):  # Decimal overflows
        raw = httpx.post(
            router.url + "/admin/wallets/acme/credit",
            content=huge,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=5,
        )
        assert raw.status_code == 400, raw.text
    for query in ("limit=%C2%B2", "before=%C2%B9"):  # digits to str.isdigit, not to int()
        assert admin(router, "GET", f"/admin/wallets/acme/ledger?{query}").status_code == 400
    assert admin(router, "GET", "/admin/wallets/acme").json()["balance"] == "1"
    assert ledger_up(router)  # a bad credit is its sender's problem, nobody else's


def test_a_retried_credit_with_a_reference_is_applied_once(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    router = start(make_cluster, tmp_path, pg.dsn(), ["acme"])
    body = {"amount": "25.00", "note": "invoice 118", "reference": "inv-118"}
    first = admin(router, "POST", "/admin/wallets/acme/credit", body).json()
    again = admin(router, "POST", "/admin/wallets/acme/credit", body).json()
    assert (first["applied"], again["applied"]) == (True, False)
    assert first["balance"] == again["balance"] == "25.00"
    other = admin(router, "POST", "/admin/wallets/acme/credit", {**body, "amount": "30"})
    assert other.status_code == 400 and "was used for a credit of 25.00" in other.text
    page = admin(router, "GET", "/admin/wallets/acme/ledger").json()
    assert [e["reference"] for e in page["entries"]] == ["inv-118"]
    # A tenant name may hold a slash or a percent sign (found by a new user: the decoded
    # path split the name, and the wallet could be neither read nor credited).
    for tenant in ("team/a", "50%off", ".."):
        path = "/admin/wallets/" + quote(tenant, safe="").replace(".", "%2E")
        credited = admin(router, "POST", path + "/credit", {"amount": "2.00"})
        assert credited.status_code == 200, credited.text
        wallet = admin(router, "GET", path).json()
        assert (wallet["tenant"], wallet["balance"]) == (tenant, "2.00")


def test_unknown_wallets_bad_pages_and_a_lost_database(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    router = start(make_cluster, tmp_path, pg.dsn(), ["acme"])
    for path in ("/admin/wallets/nobody", "/admin/wallets/nobody/ledger"):
        missing = admin(router, "GET", path)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    for query in ("limit=0", "limit=501", "limit=x", "before=-1"):
        page = admin(router, "GET", f"/admin/wallets/acme/ledger?{query}")
        assert page.status_code == 400, query
    too_long = admin(router, "GET", "/admin/wallets/" + "x" * 129)
    assert too_long.status_code == 400
    pg.kill()
    down = admin(router, "GET", "/admin/wallets/acme")
    assert down.status_code == 503 and down.json()["error"]["code"] == "backend_unavailable"


def test_an_unreachable_dsn_at_start_serves_unbilled_and_hides_the_password(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    dsn = "postgresql://billing:s3cret-pw@127.0.0.1:1/wallets"
    router = start(make_cluster, tmp_path, dsn, ["acme"], up=False)
    serving(make_cluster, [router])
    with router.openai(key("acme")) as client:
        assert ask(client)  # fail-open: no wallet, yet served
    text = router.metrics()
    assert metric(text, "hivenet_ledger_up") == 0.0
    assert metric(text, "hivenet_wallet_unbilled_total") == 1.0
    log = router.proc.log()
    assert "ledger unreachable" in log and "s3cret-pw" not in log
    assert "s3cret-pw" not in text


def test_the_output_bound_is_lowered_to_what_the_balance_pays_for(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    """0.02 pays for the input estimate of "Say hi." (7 tokens, 0.007) and 6 output tokens
    at 0.002: a request for 200 goes out with 6, and the wallet does not go below zero.
    With `min_output_tokens: 16` the same balance is refused 402, its hold given back."""
    router = start(make_cluster, tmp_path, pg.dsn(), ["acme"])
    serving(make_cluster, [router])
    credit(router, "acme", "0.02")
    with router.openai(key("acme")) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=PROMPT, max_tokens=200
        )
        assert raw.headers["x-hivenet-output-bound"] == "6"
        usage = raw.parse().usage
        assert usage is not None and usage.completion_tokens <= 6
    wait_until(lambda: charges(pg, "acme") == 1, timeout=10)
    balance = Decimal(pg.psql("SELECT balance FROM wallets WHERE tenant = 'acme'"))
    assert balance >= 0
    policy = tmp_path / "policy.yaml"
    policy.write_text(PRICES + "min_output_tokens: 16\nrouting_policy: {strategy: least-loaded}\n")
    reload = admin(router, "POST", "/admin/reload")
    assert reload.status_code == 200, reload.text
    credit(router, "acme", str(Decimal("0.02") - balance))  # back to 0.02
    with router.openai(key("acme")) as client, pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=200)
    assert refused.value.status_code == 402
    assert "pays for 6 output tokens" in str(refused.value.body)
    wait_until(lambda: reconciled(router)["ok"] is True, timeout=10)
    assert pg.psql("SELECT held FROM wallets WHERE tenant = 'acme'").strip() in ("0", "0.000")
    assert charges(pg, "acme") == 1


def hold_calls(pg: Postgres) -> int:
    found = pg.psql("SELECT calls FROM pg_stat_user_functions WHERE funcname = 'wallet_hold'")
    return int(found or 0)


def test_a_request_refused_by_a_limit_never_touches_the_ledger(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    """Admission's limits come before the wallet: once the key's daily budget is spent, its
    requests are refused 429 without a wallet_hold call (PostgreSQL's own function count)."""
    pg.psql("ALTER DATABASE postgres SET track_functions = 'pl'")
    args = files(tmp_path, ["acme"])
    auth = tmp_path / "auth.yaml"
    auth.write_text(
        auth.read_text().replace(
            "metadata: {name: k-acme, owner: acme}",
            "metadata: {name: k-acme, owner: acme}\n      quota: {tokens_per_day: 30}",
        )
    )
    router = make_cluster.router(
        "--ledger-dsn", pg.dsn(), "--ledger-timeout", "500ms", *args
    )  # fmt: skip
    wait_until(lambda: ledger_up(router), timeout=10)
    serving(make_cluster, [router])
    credit(router, "acme", "5")
    with router.openai(key("acme")) as client:
        client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=20)
        # PostgreSQL writes a backend's function counts out once it has been idle a while
        # (PGSTAT_IDLE_INTERVAL, 10 s): bounded well past that, for a busy machine.
        wait_until(lambda: hold_calls(pg) == 1, timeout=60)
        for _ in range(3):
            with pytest.raises(openai.RateLimitError) as refused:
                client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=20)
            assert "daily" in str(refused.value.body), refused.value.body
    pg.psql("SELECT pg_stat_force_next_flush()")
    assert hold_calls(pg) == 1
    assert charges(pg, "acme") == 1
