"""Engine adapters: where each engine answers health checks, and how to read its metrics.

An adapter is chosen by `--engine` from ADAPTERS. A metric the engine does not expose stays
absent from the snapshot rather than reading as zero.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

from hivenet_router.domain.agent import EngineSnapshot


class EngineAdapter(Protocol):
    name: str

    def health_path(self) -> str: ...

    def metrics_path(self) -> str | None: ...

    def parse_metrics(self, text: str) -> EngineSnapshot: ...


@dataclass(frozen=True, slots=True)
class _Samples:
    """Metric samples summed over label sets; histogram buckets summed per bound."""

    scalars: dict[str, float]
    buckets: dict[str, list[tuple[float, float]]]

    @classmethod
    def parse(cls, text: str) -> _Samples:
        scalars: dict[str, float] = defaultdict(float)
        buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_bucket") and "le" in sample.labels:
                    bound = float(sample.labels["le"])
                    buckets[sample.name[: -len("_bucket")]][bound] += sample.value
                else:
                    scalars[sample.name] += sample.value
        return cls(
            dict(scalars), {name: sorted(bounds.items()) for name, bounds in buckets.items()}
        )

    def get(self, *names: str) -> float | None:
        for name in names:
            if name in self.scalars:
                return self.scalars[name]
        return None

    def mean(self, name: str) -> float | None:
        count = self.scalars.get(name + "_count")
        total = self.scalars.get(name + "_sum")
        if not count or total is None:
            return None
        return total / count

    def quantile(self, name: str, q: float) -> float | None:
        """Estimate a quantile from cumulative buckets, interpolating inside the bucket."""
        points = self.buckets.get(name)
        if not points or points[-1][1] <= 0:
            return None
        target = q * points[-1][1]
        prev_bound, prev_count = 0.0, 0.0
        for bound, count in points:
            if count >= target:
                if math.isinf(bound):
                    return prev_bound
                span = count - prev_count
                share = (target - prev_count) / span if span > 0 else 1.0
                return prev_bound + (bound - prev_bound) * share
            prev_bound, prev_count = bound, count
        return prev_bound


def _ratio(hits: float | None, queries: float | None) -> float | None:
    if hits is None or not queries:
        return None
    return hits / queries


class VllmAdapter:
    name = "vllm"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str | None:
        return "/metrics"

    def parse_metrics(self, text: str) -> EngineSnapshot:
        s = _Samples.parse(text)
        ttft = "vllm:time_to_first_token_seconds"
        itl = (
            "vllm:inter_token_latency_seconds"
            if "vllm:inter_token_latency_seconds" in s.buckets
            else "vllm:time_per_output_token_seconds"
        )
        return EngineSnapshot(
            kv_cache_utilization=s.get("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            running_requests=s.get("vllm:num_requests_running"),
            waiting_requests=s.get("vllm:num_requests_waiting"),
            preemptions_total=s.get("vllm:num_preemptions_total"),
            avg_ttft_seconds=s.mean(ttft),
            p90_ttft_seconds=s.quantile(ttft, 0.9),
            avg_itl_seconds=s.mean(itl),
            p90_itl_seconds=s.quantile(itl, 0.9),
            prompt_tokens_total=s.get("vllm:prompt_tokens_total"),
            generation_tokens_total=s.get("vllm:generation_tokens_total"),
            prefix_cache_hit_rate=_ratio(
                s.get("vllm:prefix_cache_hits_total"), s.get("vllm:prefix_cache_queries_total")
            ),
        )


class SglangAdapter:
    name = "sglang"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str | None:
        return "/metrics"

    def parse_metrics(self, text: str) -> EngineSnapshot:
        s = _Samples.parse(text)
        ttft = "sglang:time_to_first_token_seconds"
        return EngineSnapshot(
            kv_cache_utilization=s.get("sglang:token_usage"),
            running_requests=s.get("sglang:num_running_reqs"),
            waiting_requests=s.get("sglang:num_queue_reqs"),
            avg_ttft_seconds=s.mean(ttft),
            p90_ttft_seconds=s.quantile(ttft, 0.9),
            prompt_tokens_total=s.get("sglang:prompt_tokens_total"),
            generation_tokens_total=s.get("sglang:generation_tokens_total"),
            prefix_cache_hit_rate=s.get("sglang:cache_hit_rate"),
        )


class LlamaCppAdapter:
    name = "llamacpp"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str | None:
        return "/metrics"

    def parse_metrics(self, text: str) -> EngineSnapshot:
        s = _Samples.parse(text)
        decoded = s.get("llamacpp:tokens_predicted_total")
        decode_seconds = s.get("llamacpp:tokens_predicted_seconds_total")
        itl = decode_seconds / decoded if decoded and decode_seconds is not None else None
        return EngineSnapshot(
            kv_cache_utilization=s.get("llamacpp:kv_cache_usage_ratio"),
            running_requests=s.get("llamacpp:requests_processing"),
            waiting_requests=s.get("llamacpp:requests_deferred"),
            avg_itl_seconds=itl,
            prompt_tokens_total=s.get("llamacpp:prompt_tokens_total"),
            generation_tokens_total=decoded,
        )


class PlainAdapter:
    """Engines without metrics the router reads: Ollama, Infinity, custom servers."""

    def __init__(self, name: str, health: str) -> None:
        self.name = name
        self._health = health

    def health_path(self) -> str:
        return self._health

    def metrics_path(self) -> str | None:
        return None

    def parse_metrics(self, text: str) -> EngineSnapshot:
        return EngineSnapshot()


def adapter_for(engine: str) -> EngineAdapter:
    adapters: dict[str, EngineAdapter] = {
        "vllm": VllmAdapter(),
        "sglang": SglangAdapter(),
        "llamacpp": LlamaCppAdapter(),
        "ollama": PlainAdapter("ollama", "/api/version"),
        "infinity": PlainAdapter("infinity", "/health"),
        "custom": PlainAdapter("custom", "/health"),
        "openai": PlainAdapter("openai", "/v1/models"),
    }
    return adapters[engine]
