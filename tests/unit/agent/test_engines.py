from __future__ import annotations

import msgspec
import pytest

from hivenet_router.agent.engines import adapter_for
from hivenet_router.agent.monitor import signal_key
from hivenet_router.domain.agent import Heartbeat
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


# A vLLM page, trimmed: the info gauge carries its facts as labels, whose order differs
# between versions (here block_size comes last, after a `mamba_block_size` that must not be
# read as it).
VLLM = """
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.031
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",\
mamba_block_size="8",num_cpu_blocks="None",num_gpu_blocks="27616",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",\
swap_space="4",block_size="16"} 1.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
"""

SGLANG_CACHE = """
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="Qwen/Qwen2.5-7B-Instruct"} 1048576.0
"""


def test_vllm_cache_size_from_its_info_gauge() -> None:
    snap = adapter_for("vllm").parse_metrics(VLLM)
    assert snap.kv_cache_tokens == 27616 * 16
    assert snap.running_requests == 2  # the other lines read as before


def test_vllm_cache_size_sums_engine_cores() -> None:
    line = 'vllm:cache_config_info{{block_size="16",engine="{n}",num_gpu_blocks="100"}} 1.0'
    page = "\n".join(line.format(n=n) for n in range(2))
    assert adapter_for("vllm").parse_metrics(page).kv_cache_tokens == 3200


@pytest.mark.parametrize(
    "line",
    [
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0',
        'vllm:cache_config_info{block_size="16"} 1.0',
        'vllm:cache_config_info{num_gpu_blocks="100",mamba_block_size="16"} 1.0',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="0"} 1.0',
        'vllm:cache_config_info{block_size="sixteen",num_gpu_blocks="100"} 1.0',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1e400"} 1.0',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="100" 1.0',
        'vllm:cache_config_info{block_size="16,num_gpu_blocks="100} 1.0',
        "vllm:cache_config_info 1.0",
        "vllm:cache_config_info",
    ],
)
def test_a_bad_vllm_cache_line_leaves_the_size_unknown(line: str) -> None:
    kept = [row for row in VLLM.splitlines() if not row.startswith("vllm:cache_config_info")]
    snap = adapter_for("vllm").parse_metrics("\n".join([*kept, line, ""]))
    assert snap.kv_cache_tokens is None
    assert snap.running_requests == 2


def test_sglang_cache_size() -> None:
    snap = adapter_for("sglang").parse_metrics(SGLANG + SGLANG_CACHE)
    assert snap.kv_cache_tokens == 1048576
    assert adapter_for("sglang").parse_metrics(SGLANG).kv_cache_tokens is None
    bad = SGLANG_CACHE.replace("1048576.0", "NaN")
    assert adapter_for("sglang").parse_metrics(bad).kv_cache_tokens is None


def test_vllm_adapter_reads_the_simulators_cache_size() -> None:
    snap = adapter_for("vllm").parse_metrics(render_metrics(small_engine(), "m", 0))
    assert snap.kv_cache_tokens == 1000  # 250 blocks of 4 tokens


def test_a_new_cache_size_is_a_routing_change() -> None:
    known = adapter_for("vllm").parse_metrics(VLLM)
    unknown = msgspec.structs.replace(known, kv_cache_tokens=None)
    assert signal_key(known, None) != signal_key(unknown, None)
    assert signal_key(known, None) == signal_key(adapter_for("vllm").parse_metrics(VLLM), None)


# One histogram with a placeholder for its sum, count or a bucket, and a finish reason.
HISTOGRAM = """
vllm:time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} {bucket}
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} 2
vllm:time_to_first_token_seconds_sum{{model_name="m"}} {total}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {count}
vllm:request_success_total{{finished_reason="stop",model_name="m"}} 2
"""


@pytest.mark.parametrize("garbage", ["NaN", "+Inf", "-Inf", "1e400", "-1"])
@pytest.mark.parametrize("field", ["bucket", "total", "count"])
def test_a_histogram_with_a_figure_json_cannot_carry_is_left_out(field: str, garbage: str) -> None:
    figures = {"bucket": "1", "total": "0.3", "count": "2"} | {field: garbage}
    found = adapter_for("vllm").parse_histograms(HISTOGRAM.format(**figures))
    assert found is not None and found.ttft_seconds is None
    assert found.finished == {"stop": 2}  # the rest still goes
    heartbeat = Heartbeat(backend_healthy=True, histograms=found)
    msgspec.json.Decoder(Heartbeat).decode(msgspec.json.encode(heartbeat))


def test_a_sound_histogram_passes() -> None:
    page = HISTOGRAM.format(bucket="1", total="0.3", count="2")
    found = adapter_for("vllm").parse_histograms(page)
    assert found is not None and found.ttft_seconds is not None
    assert (found.ttft_seconds.count, found.ttft_seconds.sum) == (2, 0.3)


def test_a_histogram_that_overflows_when_summed_is_left_out() -> None:
    page = HISTOGRAM.format(bucket="1", total="1e308", count="2")
    page += 'vllm:time_to_first_token_seconds_sum{model_name="n"} 1e308\n'
    found = adapter_for("vllm").parse_histograms(page)
    assert found is not None and found.ttft_seconds is None


@pytest.mark.parametrize("garbage", ["NaN", "+Inf", "-Inf", "1e400", "-1"])
def test_a_finish_reason_with_a_figure_json_cannot_carry_is_left_out(garbage: str) -> None:
    page = "\n".join(
        [
            'vllm:request_success_total{finished_reason="stop",engine="0"} 3',
            f'vllm:request_success_total{{finished_reason="stop",engine="1"}} {garbage}',
            'vllm:request_success_total{finished_reason="length",engine="0"} 1',
        ]
    )
    found = adapter_for("vllm").parse_histograms(page)
    assert found is not None and found.finished == {"length": 1}
    heartbeat = Heartbeat(backend_healthy=True, histograms=found)
    msgspec.json.Decoder(Heartbeat).decode(msgspec.json.encode(heartbeat))


def test_ratios_are_averaged_over_engine_cores_and_counts_summed() -> None:
    vllm = """
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.8
vllm:num_requests_running{engine="0",model_name="m"} 4
vllm:num_requests_running{engine="1",model_name="m"} 3
"""
    snap = adapter_for("vllm").parse_metrics(vllm)
    assert snap.kv_cache_utilization == pytest.approx(0.7)
    assert snap.running_requests == 7
    old = vllm.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert adapter_for("vllm").parse_metrics(old).kv_cache_utilization == pytest.approx(0.7)


def test_sglang_ratios_are_averaged_over_ranks() -> None:
    page = """
sglang:token_usage{model_name="m",dp_rank="0"} 0.6
sglang:token_usage{model_name="m",dp_rank="1"} 0.6
sglang:cache_hit_rate{model_name="m",dp_rank="0"} 0.5
sglang:cache_hit_rate{model_name="m",dp_rank="1"} 0.7
sglang:num_running_reqs{model_name="m",dp_rank="0"} 2
sglang:num_running_reqs{model_name="m",dp_rank="1"} 5
"""
    snap = adapter_for("sglang").parse_metrics(page)
    assert snap.kv_cache_utilization == pytest.approx(0.6)
    assert snap.prefix_cache_hit_rate == pytest.approx(0.6)
    assert snap.running_requests == 7


def test_a_tab_may_separate_name_and_value() -> None:
    snap = adapter_for("vllm").parse_metrics("vllm:num_requests_running\t7\n")
    assert snap.running_requests == 7
    page = "llamacpp:kv_cache_usage_ratio\t0.5\nllamacpp:requests_processing \t2\t1700000000\n"
    snap = adapter_for("llamacpp").parse_metrics(page)
    assert (snap.kv_cache_utilization, snap.running_requests) == (0.5, 2)
