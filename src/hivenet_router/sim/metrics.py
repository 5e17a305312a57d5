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
    lines.append("# TYPE vllm:request_success_total counter")
    for reason, count in stats.finished.items():
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {count}')
    _histogram(lines, "vllm:time_to_first_token_seconds", labels, stats.ttft)
    _histogram(lines, "vllm:time_per_output_token_seconds", labels, stats.itl)
    _histogram(lines, "vllm:inter_token_latency_seconds", labels, stats.itl)
    _histogram(lines, "vllm:request_prompt_tokens", labels, stats.prompt)
    _histogram(lines, "vllm:request_generation_tokens", labels, stats.generation)
    return "\n".join(lines) + "\n"
