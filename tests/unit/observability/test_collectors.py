"""What the metrics read at scrape time: agents, their snapshots, state, requests in flight."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from hivenet_router.domain.agent import (
    EngineHistograms,
    GpuSnapshot,
    HardwareSnapshot,
    Histogram,
    Registration,
)
from hivenet_router.domain.request import Usage
from hivenet_router.observability.collectors import (
    AgentCollector,
    RequestsCollector,
    StateCollector,
)
from hivenet_router.router.registry import AgentRecord
from tests.procs import metric


def page(*collectors: object) -> str:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def record() -> AgentRecord:
    reg = Registration(
        peer_id="p",
        model="m",
        capability="llm",
        engine="vllm",
        capacity=4,
        region="eu",
        organization="acme",
        machine="box1",
    )
    return AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)


def test_agents_are_read_at_scrape_time_with_the_reference_labels() -> None:
    agent = record()
    agents = [agent]
    collector = AgentCollector(lambda: [(a, 2) for a in agents])
    agent.held = 2
    agent.finished(True, 10.0, Usage(3, 4))
    agent.last_seen_wall = 1_800_000_000.5
    agent.disconnects, agent.health_failures, agent.backend_failures = 1, 2, 3
    agent.held = agent.capacity
    assert not agent.try_acquire()
    text = page(collector)
    routing = {"peer_id": "p", "region": "eu", "engine": "vllm", "capacity": "4"}
    assert metric(text, "hivenet_routing_agent_healthy", **routing) == 0  # not connected
    assert metric(text, "hivenet_routing_agent_last_seen_timestamp", **routing) == (
        1_800_000_000_500
    )
    ids = {"peer_id": "p", "model": "m", "engine": "vllm", "organization": "acme"}
    assert metric(text, "hivenet_agent_capacity_utilization", machine="box1", **ids) == 1.0
    assert metric(text, "hivenet_agent_requests_success_total", **ids) == 1
    assert metric(text, "hivenet_agent_output_tokens_total", **ids) == 4
    assert metric(text, "hivenet_agent_rejected_requests_total", **ids) == 1
    assert metric(text, "hivenet_agent_disconnections_total", **ids) == 1
    assert metric(text, "hivenet_agent_failure_total", **ids) == 2
    assert metric(text, "hivenet_model_backend_failure_total", **ids) == 3
    assert metric(text, "hivenet_agent_link_streams", **ids) == 2
    agents.clear()  # removed: its series go with it
    assert metric(page(collector), "hivenet_routing_agent_healthy") is None


def test_hardware_is_one_series_per_gpu() -> None:
    agent = record()
    agent.hardware = HardwareSnapshot(
        cpu_usage_percent=12.0,
        memory_total_bytes=64,
        memory_available_bytes=32,
        gpus=[
            GpuSnapshot(uuid="GPU-a", index=0, util_percent=90.0, vram_free_bytes=5),
            GpuSnapshot(uuid="GPU-b", index=3, util_percent=10.0, power_watts=250.0),
        ],
    )
    text = page(AgentCollector(lambda: [(agent, 0)]))
    assert metric(text, "hivenet_agent_cpu_usage_percent", region="eu", machine="box1") == 12.0
    assert metric(text, "hivenet_agent_memory_available_bytes", peer_id="p") == 32
    assert metric(text, "hivenet_agent_gpu_utilization_percent", gpu_index="0") == 90.0
    assert metric(text, "hivenet_agent_gpu_utilization_percent", gpu_id="p_3") == 10.0
    assert metric(text, "hivenet_agent_gpu_vram_free_bytes", gpu_index="0") == 5
    assert metric(text, "hivenet_agent_gpu_power_watts", gpu_index="3") == 250.0
    assert metric(text, "hivenet_agent_gpu_power_watts", gpu_index="0") is None


def test_engine_histograms_pass_through_per_agent() -> None:
    agent = record()
    agent.histograms = EngineHistograms(
        ttft_seconds=Histogram(bounds=[0.1, 1.0], counts=[3, 5], count=6, sum=4.5),
        finished={"stop": 5, "length": 1},
    )
    text = page(AgentCollector(lambda: [(agent, 0)]))
    assert metric(text, "hivenet_agent_engine_ttft_seconds_bucket", le="1.0", engine="vllm") == 5
    assert metric(text, "hivenet_agent_engine_ttft_seconds_bucket", le="+Inf") == 6
    assert metric(text, "hivenet_agent_engine_ttft_seconds_sum", peer_id="p") == 4.5
    assert metric(text, "hivenet_agent_engine_request_success_total", finished_reason="stop") == 5
    assert metric(text, "hivenet_agent_engine_itl_seconds_count") is None  # not reported


def test_state_and_requests_in_flight() -> None:
    text = page(
        StateCollector(
            occupancy=lambda: [("m", 120, 2)],
            limits=lambda: [("m", (900, 8))],
            waiting=lambda: [("m", 3)],
            pending=lambda: (1, 5, 90),
        ),
        RequestsCollector(
            inflight=lambda: [("POST", "/v1/chat/completions")] * 2 + [("GET", "/v1/models")],
            used_today=lambda: [("acme", 10), ("acme\x00m", 5), ("beta", 1)],
        ),
    )
    assert metric(text, "hivenet_admission_occupancy_tokens", model="m") == 120
    assert metric(text, "hivenet_queue_depth", model="m") == 3
    assert metric(text, "hivenet_router_active_forwards") == 5
    assert metric(text, "hivenet_router_forwarding_limit") == 90
    assert metric(text, "http_server_active_requests", method="POST") == 2
    assert metric(text, "hivenet_tenant_tokens_used_today", tenant_id="acme") == 15
