"""Engine adapters: where each engine answers health checks, how to read its metrics, and
where it lists its models.

An adapter is chosen by `--engine` in `adapter_for`. A metric the engine does not expose
stays absent from the snapshot rather than reading as zero. Every engine but Ollama lists
its models at the OpenAI-compatible `/v1/models`; Ollama's own `/api/tags` answers health
checks and model discovery, as the reference agent does.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import orjson

from hivenet_router.domain.agent import EngineHistograms, EngineSnapshot, Histogram


class EngineAdapter(Protocol):
    name: str

    def health_path(self) -> str: ...

    def metrics_path(self) -> str | None: ...

    def parse_metrics(self, text: str) -> EngineSnapshot: ...

    def parse_histograms(self, text: str) -> EngineHistograms | None: ...

    def models_path(self) -> str: ...

    def parse_models(self, raw: bytes) -> list[str]:
        """The model IDs a models-path answer lists, in its order; ValueError on bad JSON."""
        ...


def openai_models(raw: bytes) -> list[str]:
    """The IDs of an OpenAI-style `GET /v1/models` answer (`{"data": [{"id": ...}]}`)."""
    body = orjson.loads(raw)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return []
    return [
        item["id"]
        for item in data
        if isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"]
    ]


def ollama_models(raw: bytes) -> list[str]:
    """The names of Ollama's `GET /api/tags` answer (`{"models": [{"name": ...}]}`), with
    the implicit `:latest` tag dropped (`llama3.1:latest` registers as `llama3.1`, which
    Ollama resolves to the same model); explicit tags stay."""
    body = orjson.loads(raw)
    listed = body.get("models") if isinstance(body, dict) else None
    if not isinstance(listed, list):
        return []
    names: list[str] = []
    for item in listed:
        if not isinstance(item, dict):
            continue
        name = item.get("name") or item.get("model")
        if isinstance(name, str) and name:
            names.append(name.removesuffix(":latest"))
    return names


class _OpenAIModels:
    """Model discovery through the OpenAI-compatible `GET /v1/models`; no histograms
    unless the adapter reads them."""

    def models_path(self) -> str:
        return "/v1/models"

    def parse_histograms(self, text: str) -> EngineHistograms | None:
        return None

    def parse_models(self, raw: bytes) -> list[str]:
        return openai_models(raw)


# Most lines of one info gauge kept from a page; one per engine core is what engines write.
_MAX_INFO_LINES = 64


@dataclass(frozen=True, slots=True)
class _Samples:
    """The samples of the wanted metric families, summed over label sets; histogram
    buckets summed per bound. A ratio (one named in `_RATIOS`) is averaged over its label
    sets instead: a data-parallel engine writes one line per core or rank, and two cores at
    60% are 60% used, not 120%.

    Read with a line scanner rather than a full exposition parser: an engine's page has
    hundreds of series and the router uses a dozen, so every other line is skipped after
    comparing its name. (prometheus_client's parser was a quarter of an idle agent's work.)
    An info gauge named in `labelled` (its facts are labels, its value 1) keeps the raw
    label set of each of its lines instead, for the caller to read the labels it needs.
    """

    scalars: dict[str, float]
    buckets: dict[str, list[tuple[float, float]]]
    labels: dict[str, list[str]]

    @classmethod
    def parse(
        cls, text: str, wanted: frozenset[str], labelled: frozenset[str] = frozenset()
    ) -> _Samples:
        scalars: dict[str, float] = defaultdict(float)
        buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        labels: dict[str, list[str]] = defaultdict(list)
        shares: dict[str, int] = defaultdict(int)  # lines per ratio, to average them
        for line in text.splitlines():
            if not line or line[0] == "#":
                continue
            cut = len(line)
            for mark in ("{", " "):
                at = line.find(mark)
                if 0 <= at < cut:
                    cut = at
            # The text format allows a tab as a blank; looked for only within the name.
            tab = line.find("\t", 0, cut)
            if tab >= 0:
                cut = tab
            name = line[:cut]
            family = name[:-7] if name.endswith("_bucket") else name
            if family not in wanted and name not in wanted:
                continue
            close = line.rfind("}")
            if name in labelled:
                if close > cut and len(labels[name]) < _MAX_INFO_LINES:
                    labels[name].append(line[cut : close + 1])
                continue
            fields = line[close + 1 if close >= 0 else cut :].split()
            if not fields:
                continue
            value = _number(fields[0])
            if value is None:
                continue
            if family != name:
                bound = _label(line[cut:close], "le")
                if bound is not None:
                    buckets[family][bound] += value
                continue
            scalars[name] += value
            if name in _RATIOS:
                shares[name] += 1
        for name, lines in shares.items():
            scalars[name] /= lines
        return cls(
            dict(scalars),
            {name: sorted(bounds.items()) for name, bounds in buckets.items()},
            dict(labels),
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


def _number(text: str) -> float | None:
    try:
        return float(text)  # also +Inf, -Inf and NaN, as Prometheus writes them
    except ValueError:
        return None


def _label(labels: str, key: str) -> float | None:
    """One numeric label's value from a `{a="x",le="0.5"}` label set."""
    raw = _text_label(labels, key)
    return _number(raw) if raw else None


def _text_label(labels: str, key: str) -> str | None:
    """One label's raw value from a `{a="x",le="0.5"}` label set."""
    needle = f'{key}="'
    at = labels.find(needle)
    # Skip a match inside a longer name: block_size in mamba_block_size, say.
    while at > 0 and labels[at - 1] not in "{, ":
        at = labels.find(needle, at + 1)
    if at < 0:
        return None
    start = at + len(key) + 2
    end = labels.find('"', start)
    return labels[start:end] if end >= start else None


def _histogram(s: _Samples, name: str) -> Histogram | None:
    """The histogram as the heartbeat carries it; None if any of its figures is not finite
    and non-negative. JSON has no NaN or infinity (msgspec writes null, which the router
    refuses along with the whole heartbeat), so an engine that writes garbage loses this
    histogram, not its link."""
    points = [(b, c) for b, c in s.buckets.get(name, []) if not math.isinf(b)][:64]
    count = s.scalars.get(name + "_count")
    total = s.scalars.get(name + "_sum", 0.0)
    if count is None or not points:
        return None
    figures = [count, total, *(b for b, _ in points), *(c for _, c in points)]
    if not all(0 <= figure < math.inf for figure in figures):  # NaN fails it too
        return None
    return Histogram(
        bounds=[b for b, _ in points],
        counts=[c for _, c in points],
        count=count,
        sum=total,
    )


def _finish_reasons(text: str, family: str) -> dict[str, float]:
    """A counter's values by `finished_reason`, summed over its other labels; at most 16
    reasons of at most 32 characters (what the engine says is not trusted to be small).
    A reason with a line that is not finite and non-negative is left out: the heartbeat
    cannot carry NaN or infinity, and a sum of the other lines would undercount it."""
    found: dict[str, float] = {}
    prefix = family + "{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        close = line.rfind("}")
        reason = _text_label(line[len(family) : close + 1], "finished_reason")
        fields = line[close + 1 :].split()
        value = _number(fields[0]) if fields else None
        if reason is None or value is None or len(reason) > 32:
            continue
        if not 0 <= value < math.inf:
            value = math.nan  # poisons the sum, dropped below
        if reason in found or len(found) < 16:
            found[reason] = found.get(reason, 0.0) + value
    return {reason: count for reason, count in found.items() if 0 <= count < math.inf}


def _vllm_cache_tokens(s: _Samples) -> float | None:
    """The KV cache size in tokens from `vllm:cache_config_info`: num_gpu_blocks times
    block_size, summed over its lines (one per engine core when vLLM runs data parallel,
    each with a cache of its own). None unless every line gives both as positive numbers."""
    lines = s.labels.get(_VLLM_CACHE_INFO)
    if not lines:
        return None
    total = 0.0
    for labels in lines:
        blocks = _label(labels, "num_gpu_blocks")
        size = _label(labels, "block_size")
        tokens = _size(blocks * size) if blocks is not None and size is not None else None
        if tokens is None:
            return None
        total += tokens
    return _size(total)


def _size(value: float | None) -> float | None:
    """A cache size fit to route by: positive and finite, else unknown."""
    return value if value is not None and 0 < value < math.inf else None


def _ratio(hits: float | None, queries: float | None) -> float | None:
    if hits is None or not queries:
        return None
    return hits / queries


_VLLM = frozenset(
    f"vllm:{name}"
    for name in (
        "kv_cache_usage_perc",
        "gpu_cache_usage_perc",
        "num_requests_running",
        "num_requests_waiting",
        "num_preemptions_total",
        "time_to_first_token_seconds",
        "time_to_first_token_seconds_sum",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds",
        "inter_token_latency_seconds_sum",
        "inter_token_latency_seconds_count",
        "time_per_output_token_seconds",
        "time_per_output_token_seconds_sum",
        "time_per_output_token_seconds_count",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_hits_total",
        "prefix_cache_queries_total",
        "cache_config_info",
    )
)
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_VLLM_INFO = frozenset({_VLLM_CACHE_INFO})
_SGLANG = frozenset(
    f"sglang:{name}"
    for name in (
        "token_usage",
        "num_running_reqs",
        "num_queue_reqs",
        "time_to_first_token_seconds",
        "time_to_first_token_seconds_sum",
        "time_to_first_token_seconds_count",
        "prompt_tokens_total",
        "generation_tokens_total",
        "cache_hit_rate",
        "max_total_num_tokens",
    )
)
_LLAMACPP = frozenset(
    f"llamacpp:{name}"
    for name in (
        "tokens_predicted_total",
        "tokens_predicted_seconds_total",
        "kv_cache_usage_ratio",
        "requests_processing",
        "requests_deferred",
        "prompt_tokens_total",
        "prompt_tokens_seconds",
        "predicted_tokens_seconds",
    )
)

# The 0..1 figures read above, averaged over their label sets rather than summed (see
# `_Samples`); a ratio read from a new metric belongs here too.
_RATIOS = frozenset(
    {
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "llamacpp:kv_cache_usage_ratio",
    }
)


_VLLM_HISTOGRAMS = frozenset(
    f"vllm:{name}{part}"
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    )
    for part in ("", "_sum", "_count")
)


class VllmAdapter(_OpenAIModels):
    name = "vllm"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str | None:
        return "/metrics"

    def parse_metrics(self, text: str) -> EngineSnapshot:
        s = _Samples.parse(text, _VLLM, _VLLM_INFO)
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
            kv_cache_tokens=_vllm_cache_tokens(s),
        )

    def parse_histograms(self, text: str) -> EngineHistograms | None:
        s = _Samples.parse(text, _VLLM_HISTOGRAMS)
        itl = (
            "vllm:inter_token_latency_seconds"
            if "vllm:inter_token_latency_seconds" in s.buckets
            else "vllm:time_per_output_token_seconds"
        )
        found = EngineHistograms(
            ttft_seconds=_histogram(s, "vllm:time_to_first_token_seconds"),
            itl_seconds=_histogram(s, itl),
            request_prompt_tokens=_histogram(s, "vllm:request_prompt_tokens"),
            request_generation_tokens=_histogram(s, "vllm:request_generation_tokens"),
            finished=_finish_reasons(text, "vllm:request_success_total"),
        )
        return found if found != EngineHistograms() else None


class SglangAdapter(_OpenAIModels):
    name = "sglang"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str | None:
        return "/metrics"

    def parse_metrics(self, text: str) -> EngineSnapshot:
        s = _Samples.parse(text, _SGLANG)
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
            kv_cache_tokens=_size(s.get("sglang:max_total_num_tokens")),
        )


class LlamaCppAdapter(_OpenAIModels):
    name = "llamacpp"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str | None:
        return "/metrics"

    def parse_metrics(self, text: str) -> EngineSnapshot:
        s = _Samples.parse(text, _LLAMACPP)
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
            prompt_tps=s.get("llamacpp:prompt_tokens_seconds"),
            predicted_tps=s.get("llamacpp:predicted_tokens_seconds"),
        )


class PlainAdapter(_OpenAIModels):
    """Engines without metrics the router reads: Infinity, custom servers."""

    def __init__(self, name: str, health: str) -> None:
        self.name = name
        self._health = health

    def health_path(self) -> str:
        return self._health

    def metrics_path(self) -> str | None:
        return None

    def parse_metrics(self, text: str) -> EngineSnapshot:
        return EngineSnapshot()


class OllamaAdapter:
    """Ollama: no metrics page; `/api/tags` (the installed models) is both its health check
    and where its model is discovered."""

    name = "ollama"

    def health_path(self) -> str:
        return "/api/tags"

    def metrics_path(self) -> str | None:
        return None

    def parse_metrics(self, text: str) -> EngineSnapshot:
        return EngineSnapshot()

    def parse_histograms(self, text: str) -> EngineHistograms | None:
        return None

    def models_path(self) -> str:
        return "/api/tags"

    def parse_models(self, raw: bytes) -> list[str]:
        return ollama_models(raw)


def adapter_for(engine: str) -> EngineAdapter:
    adapters: dict[str, EngineAdapter] = {
        "vllm": VllmAdapter(),
        "sglang": SglangAdapter(),
        "llamacpp": LlamaCppAdapter(),
        "ollama": OllamaAdapter(),
        "infinity": PlainAdapter("infinity", "/health"),
        "custom": PlainAdapter("custom", "/health"),
        "openai": PlainAdapter("openai", "/v1/models"),
    }
    return adapters[engine]
