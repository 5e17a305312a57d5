"""What an agent tells the router about itself: registration, heartbeats, routing signals.

These are msgspec structs so that a payload is checked (types, sizes) while it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence
from typing import Annotated

import msgspec

Label = Annotated[str, msgspec.Meta(max_length=256)]
ShortLabel = Annotated[str, msgspec.Meta(max_length=128)]

# What an agent reports is checked for sense, not only for type: one agent's figure must
# never break a page or a routing decision for the others (a 20-digit byte count failed
# every admin view and /metrics; a pace of 1e-310 made prefix routing overflow). A figure
# out of range is dropped as if never reported, and the heartbeat is taken.
MAX_BYTES = 2**63 - 1
_SECONDS = (1e-9, 3600.0)  # or exactly 0
_FRACTION = (0.0, 1.0)
_ENGINE_BOUNDS = {
    "kv_cache_utilization": _FRACTION,
    "prefix_cache_hit_rate": _FRACTION,
    "avg_ttft_seconds": _SECONDS,
    "p90_ttft_seconds": _SECONDS,
    "avg_itl_seconds": _SECONDS,
    "p90_itl_seconds": _SECONDS,
    "kv_cache_tokens": (0.0, 1e9),
}
_COUNT = (0.0, 1e15)  # the other engine figures: counts, totals, rates


def _sensible(value: float | None, bounds: tuple[float, float]) -> float | None:
    if value is None or value == 0:
        return value
    low, high = bounds
    return value if low <= value <= high else None  # NaN fails both comparisons


def _bytes(value: int | None) -> int | None:
    return value if value is None or 0 <= value <= MAX_BYTES else None


class EngineSnapshot(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Scalar engine metrics; a field the engine never reported stays None (absent)."""

    kv_cache_utilization: float | None = None
    running_requests: float | None = None
    waiting_requests: float | None = None
    preemptions_total: float | None = None
    avg_ttft_seconds: float | None = None
    p90_ttft_seconds: float | None = None
    avg_itl_seconds: float | None = None
    p90_itl_seconds: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    prefix_cache_hit_rate: float | None = None
    predicted_tps: float | None = None  # llama.cpp: generation throughput, tokens per second
    prompt_tps: float | None = None  # llama.cpp: prompt processing, tokens per second
    kv_cache_tokens: float | None = None  # the engine's KV/prefix cache size in tokens

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _sensible(value, _ENGINE_BOUNDS.get(name, _COUNT)))


class GpuSnapshot(msgspec.Struct, omit_defaults=True):
    uuid: Annotated[str, msgspec.Meta(max_length=128)]
    index: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None  # the NVML index
    name: Annotated[str, msgspec.Meta(max_length=128)] = ""
    temperature_c: float | None = None
    util_percent: float | None = None
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    vram_free_bytes: int | None = None
    power_watts: float | None = None

    def __post_init__(self) -> None:
        self.vram_used_bytes = _bytes(self.vram_used_bytes)
        self.vram_total_bytes = _bytes(self.vram_total_bytes)
        self.vram_free_bytes = _bytes(self.vram_free_bytes)


class HardwareSnapshot(msgspec.Struct, omit_defaults=True):
    cpu_usage_percent: float | None = None
    memory_used_percent: float | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    gpus: Annotated[list[GpuSnapshot], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        self.memory_total_bytes = _bytes(self.memory_total_bytes)
        self.memory_available_bytes = _bytes(self.memory_available_bytes)

    def hottest(self) -> float | None:
        values = [g.temperature_c for g in self.gpus if g.temperature_c is not None]
        return max(values) if values else None

    def busiest(self) -> float | None:
        values = [g.util_percent for g in self.gpus if g.util_percent is not None]
        return max(values) if values else None

    def fullest_vram(self) -> float | None:
        values = [
            g.vram_used_bytes / g.vram_total_bytes
            for g in self.gpus
            if g.vram_used_bytes is not None and g.vram_total_bytes
        ]
        return max(values) if values else None


class Registration(msgspec.Struct, forbid_unknown_fields=True):
    peer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    capability: ShortLabel
    engine: ShortLabel
    capacity: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
    version: ShortLabel = "dev"
    region: Label = ""
    organization: Label = ""
    machine: Label = ""
    tags: Annotated[list[ShortLabel], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list
    )
    gpu_model: Label = ""
    deployment_id: Label = ""
    replica_id: Label = ""
    hide_llm: bool = False
    llm_pretty_name: Label = ""
    llm_info: Annotated[str, msgspec.Meta(max_length=2048)] = ""
    backend_healthy: bool = True
    # Base64 Ed25519 signature over the session's challenge: proves the peer ID.
    signature: Annotated[str, msgspec.Meta(max_length=256)] = ""


class Renewal(msgspec.Struct, forbid_unknown_fields=True):
    """A fresh session for a live connection, proven like a registration."""

    session_token: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    signature: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class Histogram(msgspec.Struct):
    """An engine histogram as its /metrics page had it: cumulative counts per upper bound
    (+Inf excluded), the total count and the sum."""

    bounds: Annotated[list[float], msgspec.Meta(max_length=64)]
    counts: Annotated[list[float], msgspec.Meta(max_length=64)]
    count: float
    sum: float


class EngineHistograms(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """What the engine's histograms and finish reasons say, for monitoring only: sent with
    heartbeats (they change with every request, so routing signals leave them out)."""

    ttft_seconds: Histogram | None = None
    itl_seconds: Histogram | None = None
    request_prompt_tokens: Histogram | None = None
    request_generation_tokens: Histogram | None = None
    finished: Annotated[
        dict[Annotated[str, msgspec.Meta(max_length=32)], float], msgspec.Meta(max_length=16)
    ] = msgspec.field(default_factory=dict)


class Heartbeat(msgspec.Struct):
    backend_healthy: bool
    active_requests: int = 0
    # Requests in flight on the agent from every router it serves; sent by an agent that
    # serves several routers, absent otherwise (a router then counts its own alone).
    inflight_total: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] | None = None
    # The router IDs the agent has a live session with: when every agent a router hears
    # from says another router is gone, that router may give it up (docs/site.md).
    routers_up: (
        Annotated[list[Annotated[str, msgspec.Meta(max_length=64)]], msgspec.Meta(max_length=256)]
        | None
    ) = None
    engine: EngineSnapshot | None = None
    hardware: HardwareSnapshot | None = None
    histograms: EngineHistograms | None = None
    # The agent is shutting down (SIGTERM): it finishes what it has in flight, and the
    # router sends it nothing new. Older routers ignore the member.
    stopping: bool = False


# Prefix blocks at most in one cache report (8 bytes each, base64: 44 KiB), so a report
# always fits a control call; a larger picture goes out in several.
MAX_REPORT_BLOCKS = 4096
PREFIX_HEADER = "x-hivenet-prefix"
"""The header that carries a forwarded prompt's prefix block hashes to the agent (base64 of
big-endian signed 64-bit integers, the router's `prompt_blocks`); the agent drops it."""


class CacheChange(msgspec.Struct, array_like=True):
    """Blocks that became the engine's most recent, in that order (`held`), or that it
    evicted. `blocks` is base64 of big-endian signed 64-bit block hashes."""

    held: bool
    blocks: Annotated[str, msgspec.Meta(max_length=(MAX_REPORT_BLOCKS * 8 + 2) // 3 * 4)]


class CacheReport(msgspec.Struct, forbid_unknown_fields=True):
    """Which prompt-prefix blocks the agent's engine holds: with `full`, everything the
    router knew of it is replaced by the changes that follow; else they apply in order."""

    full: bool = False
    changes: Annotated[list[CacheChange], msgspec.Meta(max_length=MAX_REPORT_BLOCKS)] = (
        msgspec.field(default_factory=list)
    )


def pack_blocks(blocks: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f">{len(blocks)}q", *blocks)).decode()


def unpack_blocks(text: str) -> tuple[int, ...]:
    """The hashes `pack_blocks` wrote; ValueError for anything else."""
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64: {exc}") from None
    if len(raw) % 8:
        raise ValueError("not a whole number of 8-byte hashes")
    return struct.unpack(f">{len(raw) // 8}q", raw)


class RoutingSignal(msgspec.Struct):
    engine: EngineSnapshot | None = None
    hardware: HardwareSnapshot | None = None


CAPABILITIES = ("llm", "embedding", "reranker")
# The engines an agent registers as (`--engine`), and the other names one is known by.
ENGINES = ("vllm", "sglang", "llamacpp", "ollama", "infinity", "custom", "openai")
ENGINE_ALIASES = {"llama-cpp": "llamacpp"}


def engine_name(value: str) -> str | None:
    """The name an agent registers an engine under, or None for no known engine."""
    name = value.strip().lower()
    name = ENGINE_ALIASES.get(name, name)
    return name if name in ENGINES else None


# Which capability a public route needs from the agent that serves it.
ROUTE_CAPABILITY: dict[str, str] = {
    "/v1/chat/completions": "llm",
    "/v1/completions": "llm",
    "/v1/messages": "llm",
    "/v1/messages/count_tokens": "llm",
    "/v1/embeddings": "embedding",
    "/v1/rerank": "reranker",
}
