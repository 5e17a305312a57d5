"""Prometheus text in vLLM's metric names, rendered from the engine model."""

from __future__ import annotations

from hivenet_router.sim.engine import Engine, Histogram


def _histogram(lines: list[str], name: str, labels: str, hist: Histogram) -> None:
    lines.append(f"# TYPE {name} histogram")
    for bound, count in zip(hist.buckets, hist.counts, strict=True):
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {count}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {hist.total}')
    lines.append(f"{name}_sum{{{labels}}} {hist.sum}")
    lines.append(f"{name}_count{{{labels}}} {hist.total}")


def _cache_config(lines: list[str], engine: Engine) -> None:
    """vLLM's info gauge for its KV cache: the configuration as labels, value 1. The labels
    follow vLLM's CacheConfig order, unsorted, as vLLM writes them (no model_name; `engine`
    is the engine core's index). From num_gpu_blocks times block_size a router learns how
    many tokens the prefix cache can hold."""
    labels = ",".join(
        f'{key}="{value}"'
        for key, value in (
            ("block_size", engine.block_size),
            ("gpu_memory_utilization", 0.9),
            ("swap_space", 4),
            ("cache_dtype", "auto"),
            ("is_attention_free", False),
            ("num_gpu_blocks_override", None),
            ("sliding_window", None),
            ("enable_prefix_caching", True),
            ("prefix_caching_hash_algo", "sha256"),
            ("cpu_offload_gb", 0),
            ("calculate_kv_scales", False),
            ("num_gpu_blocks", engine.kv_cache_tokens // engine.block_size),
            ("num_cpu_blocks", None),
            ("engine", 0),
        )
    )
    lines.append("# TYPE vllm:cache_config_info gauge")
    lines.append(f"vllm:cache_config_info{{{labels}}} 1.0")


def render_metrics(engine: Engine, model: str, requests: int) -> str:
    labels = f'model_name="{model}"'
    stats = engine.stats
    lines: list[str] = []

    def gauge(name: str, value: float) -> None:
        lines.append(f"# TYPE {name} gauge")
        lines.append(f"{name}{{{labels}}} {value}")

    def counter(name: str, value: float) -> None:
        lines.append(f"# TYPE {name} counter")
        lines.append(f"{name}{{{labels}}} {value}")

    counter("hivenet_sim_requests_total", requests)
    gauge("vllm:num_requests_running", engine.running)
    gauge("vllm:num_requests_waiting", engine.waiting)
    gauge("vllm:kv_cache_usage_perc", engine.kv_usage)
    gauge("vllm:gpu_cache_usage_perc", engine.kv_usage)
    counter("vllm:prompt_tokens_total", stats.prompt_tokens)
    counter("vllm:generation_tokens_total", stats.generation_tokens)
    counter("vllm:num_preemptions_total", stats.preemptions)
    counter("vllm:prefix_cache_queries_total", stats.prefix_queries)
    counter("vllm:prefix_cache_hits_total", stats.prefix_hits)
    _cache_config(lines, engine)
    lines.append("# TYPE vllm:request_success_total counter")
    for reason, count in stats.finished.items():
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {count}')
    _histogram(lines, "vllm:time_to_first_token_seconds", labels, stats.ttft)
    _histogram(lines, "vllm:time_per_output_token_seconds", labels, stats.itl)
    _histogram(lines, "vllm:inter_token_latency_seconds", labels, stats.itl)
    _histogram(lines, "vllm:request_prompt_tokens", labels, stats.prompt)
    _histogram(lines, "vllm:request_generation_tokens", labels, stats.generation)
    return "\n".join(lines) + "\n"
