"""Every option of `hivenet-sim`, the engine simulator, declared once."""

from __future__ import annotations

from dataclasses import dataclass

from hivenet_router.config import values as v
from hivenet_router.config.options import ConfigError, duration_option, option


def _factor(text: str) -> float:
    """A slowdown factor: a finite number of at least 1."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    # A factor below 1 would speed the engine up; infinity would stop it without saying so.
    if not 1.0 <= value < float("inf"):
        raise ValueError(f"{value} must be at least 1 (and finite)")
    return value


@dataclass(frozen=True, slots=True)
class SimConfig:
    host: str = option("127.0.0.1", parse=v.text, flag="--host", help="Address to listen on")
    port: int = option(8888, parse=v.port, flag="--port", help="TCP port to listen on")
    model: str = option("sim-model", parse=v.text, flag="--model", help="Model ID it serves")
    seed: int = option(0, parse=v.integer, flag="--seed", help="Seed for generated text and faults")
    workers: int = option(
        1,
        parse=v.positive_int,
        flag="--workers",
        help="Processes sharing the port (SO_REUSEPORT); each models its own engine",
    )
    zero_latency: bool = option(
        False,
        parse=v.boolean,
        flag="--zero-latency",
        help="Set every simulated delay to zero (for router benchmarks)",
    )
    max_num_seqs: int = option(
        64,
        parse=v.positive_int,
        flag="--max-num-seqs",
        help="Most sequences decoded at once; the rest wait",
    )
    kv_cache_tokens: int = option(
        65_536,
        parse=v.positive_int,
        flag="--kv-cache-tokens",
        help="KV-cache budget in tokens, shared by running sequences and the prefix cache",
    )
    block_size: int = option(
        16,
        parse=v.positive_int,
        flag="--block-size",
        help="Tokens per KV-cache block",
    )
    max_model_len: int = option(
        8192,
        parse=v.positive_int,
        flag="--max-model-len",
        help="Context length; longer prompt plus max_tokens is refused like vLLM does",
    )
    kv_events_port: int = option(
        0,
        parse=v.port,
        flag="--kv-events-port",
        help="Publish KV-cache events as vLLM does (ZeroMQ PUB, msgpack batches) on this "
        "TCP port of --host; 0 publishes none. With one worker only",
    )
    kv_events_topic: str = option(
        "",
        parse=v.text,
        flag="--kv-events-topic",
        help="Topic frame of every KV-event message (vLLM's kv-events-config topic)",
    )
    ttft_base: float = duration_option(
        0.02,
        flag="--ttft-base",
        positive=False,
        help="Fixed part of the time to first token",
    )
    prefill_per_token: float = duration_option(
        0.00005,
        flag="--prefill-per-token",
        positive=False,
        help="Prefill time per uncached prompt token",
    )
    itl: float = duration_option(
        0.015,
        flag="--itl",
        positive=False,
        help="Time per output token for a sequence decoding alone",
    )
    batch_slowdown: float = option(
        0.02,
        parse=v.non_negative_float,
        flag="--batch-slowdown",
        help="Extra share of --itl per additional running sequence",
    )
    output_tokens: int = option(
        64,
        parse=v.positive_int,
        flag="--output-tokens",
        help="Tokens generated when a request sets no max_tokens",
    )
    answer_cap: int = option(
        0,
        parse=v.non_negative_int,
        flag="--answer-cap",
        help="Longest answer in tokens: a request that allows more gets this many and stops "
        "naturally, as a model that has said what it had to say; 0 answers max_tokens in full",
    )
    usage_log: str = option(
        "",
        parse=v.text,
        flag="--usage-log",
        help="File to append one JSON line per generation request to (request_id, route, "
        "model, prompt_tokens, completion_tokens, stream, outcome): the engine's own count, "
        "for checking a router's accounting; empty writes none",
    )
    embedding_dim: int = option(
        384,
        parse=v.positive_int,
        flag="--embedding-dim",
        help="Embedding vector length",
    )
    api_key: str = option(
        "",
        parse=v.text,
        flag="--api-key",
        secret=True,
        help="Answer 401 unless a request carries Authorization: Bearer KEY, as an engine "
        "started with --api-key does (here /health and /metrics too; /admin/* stays open)",
    )
    fault_error_rate: float = option(
        0.0,
        parse=v.fraction,
        flag="--fault-error-rate",
        help="Share of requests answered with HTTP 500",
    )
    fault_latency: float = duration_option(
        0.0,
        flag="--fault-latency",
        positive=False,
        help="Delay added before every answer",
    )
    fault_hang_rate: float = option(
        0.0,
        parse=v.fraction,
        flag="--fault-hang-rate",
        help="Share of requests that never answer",
    )
    fault_stall_rate: float = option(
        0.0,
        parse=v.fraction,
        flag="--fault-stall-rate",
        help="Share of streams that stop sending halfway without ending",
    )
    fault_repeat_rate: float = option(
        0.0,
        parse=v.fraction,
        flag="--fault-repeat-rate",
        help="Share of answers stuck repeating one phrase",
    )
    fault_syntax_rate: float = option(
        0.0,
        parse=v.fraction,
        flag="--fault-syntax-rate",
        help="Share of JSON answers (structured output, tool-call arguments) broken halfway "
        "so that no continuation makes them valid JSON",
    )
    fault_crash_after: int = option(
        0,
        parse=v.non_negative_int,
        flag="--fault-crash-after",
        help="Exit the process abruptly after this many requests; 0 never",
    )
    fault_slowdown: float = option(
        1.0,
        parse=_factor,
        flag="--fault-slowdown",
        default_text="1",
        help="Multiply every engine delay (time to first token, prefill, time per output "
        "token) by this factor; 1 leaves them as configured",
    )

    def validate(self) -> None:
        if self.kv_events_port and self.workers > 1:
            raise ConfigError("--kv-events-port needs --workers 1 (one engine, one socket)")
        if self.kv_cache_tokens < self.block_size:
            raise ConfigError("--kv-cache-tokens must hold at least one --block-size block")
