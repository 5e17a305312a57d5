"""Routers of one site sharing limits through a real valkey-server, driven by the SDK."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx2 as httpx
import openai
import pytest
import yaml

from hivenet_router.domain.site import default_router_id
from tests.procs import Cluster, Router, free_port, metric, sync_view, wait_until
from tests.valkey_cluster import ValkeyCluster
from tests.valkey_site import ValkeySite

SITE_ALERTS = Path(__file__).parents[2] / "deploy" / "prometheus" / "alerts-site.yml"
MODEL = "m"
KEY = "sk-hivenet-site-0123456789"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ValkeySite]:
    with ValkeySite(tmp_path / "valkey", replicas=0, sentinels=0) as site:
        yield site


def store_flags(store: ValkeySite | ValkeyCluster) -> tuple[str, ...]:
    """How a router is told where the site's store is: one primary, or a cluster's nodes."""
    if isinstance(store, ValkeyCluster):
        return ("--sync-cluster", ",".join(store.seeds))
    return ("--sync-addr", store.primary_addr)


def site_of(
    cluster: Cluster,
    tmp: Path,
    store: ValkeySite | ValkeyCluster,
    quota: str,
    policy: str,
    routers: int = 2,
) -> list[Router]:
    auth = tmp / "auth.yaml"
    auth.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
        f"      metadata: {{name: k, owner: acme}}\n      quota: {quota}\n"
        "admin:\n  mode: api-key\n"
    )
    policy_file = tmp / "policy.yaml"
    policy_file.write_text(policy + "routing_policy: {strategy: least-loaded}\n")
    flags = [
        *("--auth-config-file", str(auth), "--policy-file", str(policy_file)),
        *("--sync-store", "valkey", *store_flags(store)),
        *("--sync-site", "test-site", "--sync-interval", "250ms"),
        *("--sync-min-routers", str(routers)),
    ]
    started = [
        cluster.router(*flags, "--router-id", f"r{index}", name=f"router{index}")
        for index in range(routers)
    ]
    sim = cluster.sim(MODEL, "--itl", "20ms", "--ttft-base", "0", "--output-tokens", "8")
    everyone = ",".join(f"127.0.0.1:{router.grpc}" for router in started)
    cluster.agent(started[0], sim, "--routers", everyone, "--capacity", "64")
    for router in started:
        wait_until(lambda r=router: metric(r.metrics(), "hivenet_routing_agent_healthy") == 1.0)
        wait_until(lambda r=router: sync_view(r)["routers"] == [f"r{i}" for i in range(routers)])
    return started


def ask(router: Router) -> bool:
    """One small chat completion; True when answered, False on 429."""
    with router.openai(KEY) as client:
        try:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        except openai.RateLimitError:
            return False
    return True


def test_two_routers_enforce_one_request_rate(
    make_cluster: Cluster, tmp_path: Path, store: ValkeySite
) -> None:
    routers = site_of(make_cluster, tmp_path, store, "{requests_per_minute: 20}", "")
    answered = 0
    for attempt in range(60):  # bounded: a few seconds of requests, alternating routers
        answered += ask(routers[attempt % 2])
    # The site's 20 per minute, plus what can go unseen in one round (see docs/site.md).
    print(f"answered {answered} of 60 requests against a site limit of 20 per minute")
    assert 15 <= answered <= 30
    for router in routers:
        assert sync_view(router)["store_up"] is True
    # every metric the site's alert rules read is exported by a router of a site
    exported = routers[0].metrics()
    rules = yaml.safe_load(SITE_ALERTS.read_text())["groups"][0]["rules"]
    for rule in rules:
        for name in re.findall(r"\bhivenet_sync_\w+", rule["expr"]):
            assert metric(exported, name) is not None, f"{rule['alert']} reads missing {name}"


def test_occupancy_credits_never_exceed_the_budget(
    make_cluster: Cluster, tmp_path: Path, store: ValkeySite
) -> None:
    routers = site_of(make_cluster, tmp_path, store, "{}", "admit_budget_tokens: 400\n")
    budget = int(0.9 * 400)  # admit fraction x budget x one replica
    client: Any = store.client()
    samples, worst = 0, 0

    def one(index: int) -> bool:
        return ask(routers[index % 2])

    with ThreadPoolExecutor(16) as pool:
        running = [pool.submit(one, index) for index in range(48)]
        while not all(future.done() for future in running):
            held = client.execute_command("HVALS", "hivenet:{test-site}:pool:" + MODEL)
            total = sum(int(value) for value in held)
            worst, samples = max(worst, total), samples + 1
            assert total <= budget, f"routers hold {total} credits of a {budget} budget"
        answered = sum(future.result() for future in running)
    print(f"{samples} samples of the pool; at most {worst} of {budget} credits held")
    assert samples > 0 and answered > 0
    views = [sync_view(router) for router in routers]
    assert all(view["store_up"] for view in views)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--sync-store", "valkey", "--sync-addr", "127.0.0.1:1", "--sync-site", "a b"),
            "sync-site",
        ),
        (
            ("--sync-store", "valkey", "--sync-addr", "127.0.0.1:1", "--sync-site", "x" * 65),
            "sync-site",
        ),
        (("--sync-store", "valkey"), "--sync-addr"),
        (("--advertise-grpc-addr", ":50051"), "advertise-grpc-addr"),
        (("--advertise-grpc-addr", "0.0.0.0:50051"), "advertise-grpc-addr"),
    ],
)
def test_bad_site_options_are_refused_at_start(
    make_cluster: Cluster, flags: tuple[str, ...], message: str
) -> None:
    assert message in make_cluster.refused_router(*flags)


def test_the_store_and_the_badger_backend_do_not_mix(make_cluster: Cluster) -> None:
    log = make_cluster.refused_router(
        "--sync-store", "valkey", "--sync-addr", "127.0.0.1:1",
        env={"HIVENET_ROUTER_QUOTA_BACKEND": "badger"},
    )  # fmt: skip
    assert "badger" in log


def test_the_site_alert_rules_are_valid_promql() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing (scripts/prometheus.sh installs it); CI is set")
        pytest.skip("promtool not installed (scripts/prometheus.sh installs it)")
    done = subprocess.run(
        [promtool, "check", "rules", str(SITE_ALERTS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rule in yaml.safe_load(SITE_ALERTS.read_text())["groups"][0]["rules"]:
        *_value, last = rule["expr"].strip().splitlines()
        assert re.fullmatch(r"[<>]=? -?\d+(\.\d+)?", last.strip()), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_routers_of_one_host_share_the_public_port(
    make_cluster: Cluster, tmp_path: Path, store: ValkeySite
) -> None:
    port = free_port()
    site = ("--sync-store", "valkey", "--sync-addr", store.primary_addr, "--sync-site", "one")
    routers = [
        make_cluster.router(
            *site,
            "--reuse-port",
            "--router-id",
            f"p{index}",
            name=f"port{index}",
            # the same public port for both, their own agent, link and metrics ports
            ports=Router(cast(Any, None), port, free_port(), free_port(), free_port()),
        )
        for index in range(2)
    ]
    sim = make_cluster.sim(MODEL, "--zero-latency")
    everyone = ",".join(f"127.0.0.1:{router.grpc}" for router in routers)
    make_cluster.agent(routers[0], sim, "--routers", everyone)
    for router in routers:
        wait_until(lambda r=router: metric(r.metrics(), "hivenet_routing_agent_healthy") == 1.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(40):  # a new connection each time: the kernel spreads them
        with httpx.Client(timeout=10) as http:
            assert http.post(f"{routers[0].url}/v1/chat/completions", json=body).status_code == 200
    served = [
        metric(router.metrics(), "hivenet_routing_requests_routed_total") or 0.0
        for router in routers
    ]
    print(f"requests served by each router on port {port}: {served}")
    assert sum(served) == 40 and all(count > 0 for count in served)


def test_a_second_router_under_a_live_router_id_refuses_to_start(
    make_cluster: Cluster, store: ValkeySite
) -> None:
    site = ("--sync-store", "valkey", "--sync-addr", store.primary_addr, "--sync-site", "dup")
    first = make_cluster.router(*site, "--sync-interval", "250ms", "--router-id", "same")
    wait_until(lambda: sync_view(first)["routers"] == ["same"])
    second = make_cluster.router(*site, "--router-id", "same", name="second", wait=False)
    assert second.proc.popen is not None and second.proc.popen.wait(timeout=30) == 1
    refused = second.proc.log()
    assert "--router-id same is taken: another live router process of site dup" in refused
    assert first.proc.popen is not None
    named = f"process {first.proc.popen.pid} on host {socket.gethostname()}, agent port "
    assert f"{named}127.0.0.1:{first.grpc}" in refused
    # The first router never noticed: the second wrote nothing under its ID.
    view = sync_view(first)
    assert view["routers"] == ["same"] and "duplicate_router_id" not in view["errors"]
    assert httpx.get(first.url + "/health", timeout=5).status_code == 200


def test_routers_of_one_host_get_their_own_default_router_ids(
    make_cluster: Cluster, store: ValkeySite
) -> None:
    site = ("--sync-store", "valkey", "--sync-addr", store.primary_addr, "--sync-site", "own")
    routers = [make_cluster.router(*site, name=f"plain{index}") for index in range(2)]
    ids = sorted(default_router_id(router.grpc) for router in routers)
    assert all(default_router_id(r.grpc).endswith(f"-{r.grpc}") for r in routers)
    for router in routers:
        wait_until(lambda r=router: sync_view(r)["routers"] == ids)


def test_two_routers_share_one_output_token_rate(
    make_cluster: Cluster, tmp_path: Path, store: ValkeySite
) -> None:
    """The output bucket, debt included, is the site's: answers of 20 tokens alternating
    between two routers stop after about 100 tokens a minute in all."""
    routers = site_of(
        make_cluster, tmp_path, store, "{output_tokens_per_minute: 100}", "mode: serverless\n"
    )
    started = time.monotonic()
    served, refused = 0, 0
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    for attempt in range(30):
        with routers[attempt % 2].openai(KEY) as client:
            try:
                completion = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=20
                )
            except openai.RateLimitError as refusal:
                assert refusal.code == "rate_limit_exceeded"
                refused += 1
                continue
        assert completion.usage is not None
        served += completion.usage.completion_tokens
    refill = (time.monotonic() - started) * 100 / 60
    print(f"served {served} output tokens against 100 a minute across two routers")
    # What one round can leave unseen: one answer on the other router.
    assert refused and served <= 100 + refill + 20
