from __future__ import annotations

import pytest

from hivenet_router.agent.engines import adapter_for
from hivenet_router.sim.engine import Engine, Timing
from hivenet_router.sim.metrics import render_metrics

SGLANG = """
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.25
sglang:num_running_reqs{model_name="m"} 3
sglang:num_queue_reqs{model_name="m"} 1
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 5
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="m"} 10
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10
sglang:time_to_first_token_seconds_sum{model_name="m"} 1.0
sglang:time_to_first_token_seconds_count{model_name="m"} 10
"""

LLAMACPP = """
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.5
llamacpp:requests_processing 2
llamacpp:requests_deferred 0
llamacpp:tokens_predicted_total 100
llamacpp:tokens_predicted_seconds_total 2
llamacpp:prompt_tokens_total 40
llamacpp:prompt_tokens_seconds 812.5
llamacpp:predicted_tokens_seconds 48.25
"""


def small_engine() -> Engine:
    return Engine(
        max_num_seqs=4,
        kv_cache_tokens=1000,
        block_size=4,
        timing=Timing(0.01, 0.0, 0.01, 0.0),
        zero_latency=True,
    )


async def test_vllm_adapter_reads_the_simulator() -> None:
    engine = small_engine()
    seq = await engine.admit(b"x" * 400, 50)
    for value in (0.01, 0.02, 0.03, 0.5):
        engine.stats.ttft.observe(value)
    snap = adapter_for("vllm").parse_metrics(render_metrics(engine, "m", 1))
    assert snap.running_requests == 1 and snap.waiting_requests == 0
    assert snap.kv_cache_utilization == pytest.approx(0.15)
    assert snap.avg_ttft_seconds == pytest.approx(0.14)
    assert snap.p90_ttft_seconds is not None and 0.25 < snap.p90_ttft_seconds <= 0.5
    assert snap.prompt_tokens_total == 100
    engine.release(seq, "stop", 50)


async def test_vllm_histograms_and_finish_reasons_pass_through() -> None:
    engine = small_engine()
    for reason, generated in (("stop", 30), ("length", 50), ("stop", 7)):
        engine.release(await engine.admit(b"x" * 400, 50), reason, generated)
    for value in (0.01, 0.5):
        engine.stats.ttft.observe(value)
    found = adapter_for("vllm").parse_histograms(render_metrics(engine, "m", 3))
    assert found is not None
    assert found.finished == {"stop": 2, "length": 1, "abort": 0}
    ttft = found.ttft_seconds
    assert ttft is not None and (ttft.count, ttft.sum) == (2, pytest.approx(0.51))
    assert ttft.counts == sorted(ttft.counts)  # cumulative, bounds ascending
    generation = found.request_generation_tokens
    assert generation is not None and generation.count == 3 and generation.sum == 87
    prompt = found.request_prompt_tokens
    assert prompt is not None and prompt.count == 3
    assert adapter_for("llamacpp").parse_histograms(LLAMACPP) is None


def test_finish_reasons_are_bounded() -> None:
    page = "\n".join(
        f'vllm:request_success_total{{finished_reason="r{n}",model_name="m"}} 1' for n in range(40)
    )
    page += '\nvllm:request_success_total{finished_reason="' + "x" * 100 + '"} 5'
    found = adapter_for("vllm").parse_histograms(page)
    assert found is not None
    assert len(found.finished) == 16
    assert all(len(reason) <= 32 for reason in found.finished)


def test_sglang_adapter() -> None:
    snap = adapter_for("sglang").parse_metrics(SGLANG)
    assert (snap.kv_cache_utilization, snap.running_requests, snap.waiting_requests) == (0.25, 3, 1)
    assert snap.avg_ttft_seconds == pytest.approx(0.1)
    assert snap.p90_ttft_seconds == pytest.approx(0.18)
    assert snap.preemptions_total is None  # absent, not zero


def test_llamacpp_adapter() -> None:
    snap = adapter_for("llamacpp").parse_metrics(LLAMACPP)
    assert (snap.kv_cache_utilization, snap.running_requests) == (0.5, 2)
    assert snap.avg_itl_seconds == pytest.approx(0.02)
    assert (snap.prompt_tps, snap.predicted_tps) == (812.5, 48.25)


@pytest.mark.parametrize("engine", ["ollama", "infinity", "custom", "openai"])
def test_engines_without_metrics(engine: str) -> None:
    adapter = adapter_for(engine)
    assert adapter.metrics_path() is None
    assert adapter.parse_metrics("whatever") == adapter.parse_metrics("")
