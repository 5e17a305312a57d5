"""The operator's console (/console/) driven in headless Chromium: sign-in, the fleet
following a drain and an agent that leaves, a policy refused with its line and field then
applied, a tenant's usage after requests, the latest requests, a wallet credit in its
ledger, and a browser that logs no error of its own. Screenshots go to build/console/."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.console.browser import chromium, problems, screenshot, wait_for
from tests.postgres import postgres_server
from tests.procs import ADMIN_KEY, Cluster, Router, metric, sync_view, wait_until

MODEL = "console-model"
TENANT = "acme"
CLIENT_KEY = "sk-console-acme-0123456789"
PROMPT = "a-prompt-the-console-must-never-show"
BAD_POLICY = "routing_policy:\n  strategy: round-robin\n  exclude_if:\n    sucess_rate: {lt: 0.5}\n"
GOOD_POLICY = "routing_policy:\n  strategy: round-robin\n"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def auth_file(tmp: Path) -> list[str]:
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    path = tmp / "auth.yaml"
    path.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{digest}"\n'
        f"      metadata: {{name: console-test, owner: {TENANT}}}\n"
        "      quota: {tokens_per_day: 100000}\n"
        "admin:\n  mode: api-key\n"
    )
    return ["--auth-config-file", str(path)]


def admin(router: Router, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(
        method, router.url + path, json=body, timeout=10,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )  # fmt: skip


def by_id(driver: Any, element: str) -> Any:
    return driver.find_element("id", element)


def sign_in(driver: Any, router: Router, key: str) -> None:
    from selenium.webdriver.common.keys import Keys

    field = wait_for(driver, lambda: by_id(driver, "admin-key"))
    field.clear()
    field.send_keys(key + Keys.ENTER)  # the keyboard alone signs in


def rows(driver: Any, table: str) -> dict[str, str]:
    """The rows of a table by their data- key, with their text."""
    out = {}
    for row in driver.find_elements("css selector", f"#{table} tbody tr"):
        key = row.get_attribute("data-peer") or row.get_attribute("data-tenant") or ""
        out[key] = row.text
    return out


def tab(driver: Any, view: str) -> None:
    driver.find_element("css selector", f'.tab[data-view="{view}"]').click()
    wait_for(driver, lambda: by_id(driver, f"view-{view}").is_displayed())


def test_console_signs_in_follows_the_fleet_and_shows_traffic(
    make_cluster: Cluster, tmp_path: Path, browser: Any
) -> None:
    c = make_cluster
    router = c.router(*auth_file(tmp_path))
    sim = c.sim(MODEL, "--zero-latency")
    c.agent(router, sim, "--model", MODEL, name="agent-a")
    wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 1.0)
    (staying,) = [
        a["peer_id"] for a in admin(router, "GET", "/admin/routing-table").json()["agents"]
    ]
    leaving = c.agent(router, sim, "--model", MODEL, name="agent-b")
    wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 2.0)
    table = admin(router, "GET", "/admin/routing-table").json()["agents"]
    (gone,) = [a["peer_id"] for a in table if a["peer_id"] != staying]
    peers = sorted([staying, gone])
    driver = browser
    driver.get(router.url + "/console/")
    assert driver.execute_script("return document.cookie") == ""

    # A wrong key sees the refusal and nothing else; the key is not kept.
    sign_in(driver, router, "not-the-admin-key")
    error = wait_for(driver, lambda: (e := by_id(driver, "signin-error")).is_displayed() and e)
    assert "401" in error.text and "unauthorized" in error.text
    assert not by_id(driver, "tabs").is_displayed()
    assert not by_id(driver, "view-fleet").is_displayed()
    assert driver.execute_script("return sessionStorage.length") == 0
    assert problems(driver, refused={401}) == []
    screenshot(driver, "signin-refused")

    # The right key: every agent, live.
    sign_in(driver, router, ADMIN_KEY)
    wait_for(driver, lambda: set(rows(driver, "fleet-table")) == set(peers))
    assert ADMIN_KEY not in driver.current_url
    assert driver.execute_script("return document.cookie") == ""
    for text in rows(driver, "fleet-table").values():
        assert MODEL in text and "healthy" in text and "in pool" in text
    screenshot(driver, "fleet")

    # Drain the first, through the confirmation.
    drained = staying
    driver.find_element("css selector", f'button.drain[data-peer="{drained}"]').click()
    wait_for(driver, lambda: by_id(driver, "confirm").is_displayed())
    assert drained in by_id(driver, "confirm-text").text
    by_id(driver, "confirm-yes").click()
    wait_for(driver, lambda: "draining" in rows(driver, "fleet-table")[drained])
    assert admin(router, "GET", f"/admin/agents/{drained}").json()["health"]["draining"]
    screenshot(driver, "fleet-drained")

    # An agent that leaves: shown disconnected, then gone once removed (--remove-after 5s).
    leaving.stop()
    wait_for(driver, lambda: gone not in rows(driver, "fleet-table"), timeout=30)
    assert set(rows(driver, "fleet-table")) == {drained}
    # Undrain by keyboard alone: Enter on the button, Shift+Tab to Confirm, Enter.
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    button = f'button.drain[data-peer="{drained}"]'
    wait_for(driver, lambda: driver.find_element("css selector", button).send_keys(Keys.ENTER) or 1)
    wait_for(driver, lambda: by_id(driver, "confirm").is_displayed())
    assert driver.switch_to.active_element.get_attribute("id") == "confirm-no"
    keys = ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT)
    keys.send_keys(Keys.ENTER).perform()
    wait_for(driver, lambda: "in pool" in rows(driver, "fleet-table")[drained])
    assert not admin(router, "GET", f"/admin/agents/{drained}").json()["health"]["draining"]

    # A policy with a mistake: its line and field; then a valid one, applied.
    tab(driver, "policies")
    text = by_id(driver, "policy-text")
    text.clear()
    text.send_keys(BAD_POLICY)
    by_id(driver, "policy-validate").click()
    where = wait_for(driver, lambda: by_id(driver, "policy-where"))
    assert where.text == "Line 4, field routing_policy.exclude_if.sucess_rate"
    assert "request_invalid" in by_id(driver, "policy-error").text
    screenshot(driver, "policy-error")
    text.clear()
    text.send_keys(GOOD_POLICY)
    by_id(driver, "policy-validate").click()
    wait_for(driver, lambda: "Valid" in by_id(driver, "policy-ok").text)
    assert (
        admin(router, "GET", "/admin/policy").json()["routing_policy"]["strategy"] != "round-robin"
    )
    by_id(driver, "policy-apply").click()
    wait_for(driver, lambda: "Applied global" in by_id(driver, "policy-ok").text)
    assert (
        admin(router, "GET", "/admin/policy").json()["routing_policy"]["strategy"] == "round-robin"
    )

    def listed() -> str:
        return str(by_id(driver, "policies-list").get_attribute("textContent"))

    wait_for(driver, lambda: "round-robin" in listed())
    assert "global: admin API (PUT /admin/policy at 20" in listed()  # the version and when
    assert problems(driver, refused={400}) == []

    # A tenant's requests: its usage, then the latest requests without their prompts.
    with router.openai(CLIENT_KEY) as client:
        for _ in range(3):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8
            )
        with pytest.raises(openai.NotFoundError):  # a refusal, counted for its tenant
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=8
            )
    tab(driver, "tenants")
    wait_for(driver, lambda: TENANT in rows(driver, "usage-table"))
    refused = f'#refusals li[data-tenant="{TENANT}"]'
    wait_for(
        driver, lambda: "model_not_found 1" in driver.find_element("css selector", refused).text
    )
    used = int(
        driver.find_element("css selector", f'#usage-table tr[data-tenant="{TENANT}"] .tokens').text
    )
    assert used > 0
    assert "100000" in rows(driver, "usage-table")[TENANT]
    screenshot(driver, "tenants")
    tab(driver, "traffic")
    wait_for(
        driver, lambda: len(driver.find_elements("css selector", "#requests-table tbody tr")) >= 3
    )
    page = driver.page_source
    assert PROMPT not in page and CLIENT_KEY not in page and ADMIN_KEY not in page
    assert TENANT in by_id(driver, "requests-table").text
    assert "Requests (hour)" in by_id(driver, "traffic-summary").text
    screenshot(driver, "traffic")
    tab(driver, "site")
    wait_for(driver, lambda: by_id(driver, "site-off").is_displayed())

    # Signing out forgets the key.
    by_id(driver, "signout").click()
    wait_for(driver, lambda: by_id(driver, "signin").is_displayed())
    assert driver.execute_script("return sessionStorage.length") == 0
    assert problems(driver) == []


def test_console_page_headers_and_off_switch(make_cluster: Cluster) -> None:
    """The page's security headers, and --console=false: no page, no console endpoints."""
    router = make_cluster.router()
    page = httpx.get(router.url + "/console/", timeout=5)
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "<script src=" in page.text and "<script>" not in page.text and "style=" not in page.text
    assert httpx.get(router.url + "/admin/requests", timeout=5).status_code == 401
    bad = admin(router, "GET", "/admin/requests?limit=9999")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "request_invalid"
    for n in range(5):  # five requests for no route: recorded, newest first, paged
        httpx.get(f"{router.url}/nowhere-{n}", timeout=5)
    first = admin(router, "GET", "/admin/requests?limit=2").json()
    assert [r["path"] for r in first["requests"]] == ["/nowhere-4", "/nowhere-3"]
    assert first["kept"] == 5 and first["next_before"] == first["requests"][-1]["seq"]
    second = admin(router, "GET", f"/admin/requests?limit=3&before={first['next_before']}")
    assert [r["path"] for r in second.json()["requests"]] == [f"/nowhere-{n}" for n in (2, 1, 0)]
    assert second.json()["next_before"] is None
    traffic = admin(router, "GET", "/admin/traffic").json()
    assert traffic["requests"] == 5 and traffic["errors_by_code"] == {"not_found": 5}
    off = make_cluster.router("--console=false", name="off")
    assert httpx.get(off.url + "/console/", timeout=5).status_code == 404
    assert admin(off, "GET", "/admin/requests").status_code == 404


def test_console_wallet_credit_shows_in_its_ledger(make_cluster: Cluster, tmp_path: Path) -> None:
    """A wallet on a real PostgreSQL (tests/postgres.py): a credit typed into the console's
    form, with its idempotency reference, appears in the balance and the ledger; the same
    reference again adds nothing; a bad amount shows the API's refusal."""
    with chromium() as driver, postgres_server() as pg:
        policy = tmp_path / "policy.yaml"
        policy.write_text(
            "prices: {input_per_million: 1000, output_per_million: 2000}\n"
            "routing_policy: {strategy: least-loaded}\n"
        )
        router = make_cluster.router(
            "--ledger-dsn", pg.dsn(), *auth_file(tmp_path), "--policy-file", str(policy)
        )
        wait_until(lambda: metric(router.metrics(), "hivenet_ledger_up") == 1.0, timeout=10)
        assert admin(router, "POST", f"/admin/wallets/{TENANT}/credit", {"amount": "1"}).is_success
        driver.get(router.url + "/console/")
        sign_in(driver, router, ADMIN_KEY)
        wait_for(driver, lambda: by_id(driver, "tabs").is_displayed())
        tab(driver, "tenants")
        by_id(driver, "wallet-tenant").send_keys(TENANT)
        by_id(driver, "wallet-load").click()
        wait_for(driver, lambda: "balance 1 " in by_id(driver, "wallet-balance").text)

        def fill(amount: str, reference: str) -> None:
            for element, value in (("credit-amount", amount), ("credit-reference", reference)):
                by_id(driver, element).clear()
                by_id(driver, element).send_keys(value)
            by_id(driver, "credit-button").click()

        fill("12.50", "console-topup-1")
        wait_for(driver, lambda: "balance 13.50 " in by_id(driver, "wallet-balance").text)
        assert "Credited 12.50" in by_id(driver, "credit-result").text
        wait_for(driver, lambda: "console-topup-1" in by_id(driver, "ledger-table").text)
        assert "12.5" in by_id(driver, "ledger-table").text
        screenshot(driver, "wallet")
        fill("12.50", "console-topup-1")  # the same reference: applied once
        wait_for(driver, lambda: "credited before" in by_id(driver, "credit-result").text)
        assert "balance 13.50 " in by_id(driver, "wallet-balance").text
        fill("-3", "console-topup-2")
        wait_for(driver, lambda: "invalid_parameter" in by_id(driver, "credit-result").text)
        assert "amount" in by_id(driver, "credit-result").text
        assert problems(driver, refused={400}) == []


def test_console_site_view(make_cluster: Cluster, tmp_path: Path) -> None:
    """With a sync store (a real valkey-server): the routers of the site and the store's
    health."""
    from tests.valkey_site import ValkeySite

    with chromium() as driver, ValkeySite(tmp_path / "valkey", replicas=0, sentinels=0) as store:
        flags = ("--sync-store", "valkey", "--sync-addr", store.primary_addr, "--sync-site", "lab")
        routers = [
            make_cluster.router(*flags, "--router-id", f"r{n}", name=f"router{n}") for n in (0, 1)
        ]
        wait_until(lambda: sync_view(routers[0])["routers"] == ["r0", "r1"])
        driver.get(routers[0].url + "/console/")
        sign_in(driver, routers[0], ADMIN_KEY)
        wait_for(driver, lambda: by_id(driver, "tabs").is_displayed())
        tab(driver, "site")
        wait_for(driver, lambda: by_id(driver, "site-routers").text.split() == ["r0", "r1"])
        assert "store up" in by_id(driver, "site-health").text
        assert not by_id(driver, "site-off").is_displayed()
        screenshot(driver, "site")
        assert problems(driver) == []
