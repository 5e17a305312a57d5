"""What a policy says about the gateway stages: prices for wallets, the response cache, the
stream-quality validator. Plain values, checked when the policy is read; a leaf module (it
imports nothing of ours), so the gateway's policy blocks (gateway/blocks.py) and the stages
can both use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from types import MappingProxyType
from typing import Final

# ISO 4217 codes in use. A price or a credit in any other currency is refused: a typo in a
# currency would otherwise open a second, empty wallet.
CURRENCIES: Final[frozenset[str]] = frozenset(
    """
    AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN
    BWP BYN BZD CAD CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD
    FKP GBP GEL GHS GIP GMD GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY
    KES KGS KHR KMF KPW KRW KWD KYD KZT LAK LBP LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP
    MRU MUR MVR MWK MXN MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR
    RON RSD RUB RWF SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB TJS TMT
    TND TOP TRY TTD TWD TZS UAH UGX USD UYU UZS VES VND VUV WST XAF XCD XCG XOF XPF YER ZAR
    ZMW ZWG
    """.split()  # noqa: SIM905 (a table reads better than 160 quoted lines)
)
DEFAULT_CURRENCY: Final = "USD"
MILLION: Final = Decimal(1_000_000)


@dataclass(frozen=True, slots=True)
class Price:
    """What a million tokens cost, read and written, in the policy's currency."""

    input_per_million: Decimal
    output_per_million: Decimal

    def cost(self, input_tokens: int, output_tokens: int) -> Decimal:
        return (
            self.input_per_million * input_tokens + self.output_per_million * output_tokens
        ) / MILLION


@dataclass(frozen=True, slots=True)
class Prices:
    """A policy's `prices` block: one price for its models, and per-model overrides."""

    currency: str = DEFAULT_CURRENCY
    default: Price | None = None
    models: tuple[tuple[str, Price], ...] = ()

    def for_model(self, model: str) -> Price | None:
        for name, price in self.models:
            if name == model:
                return price
        return self.default


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """A policy's `response_cache` block (`response_cache: {}` turns it on as it stands)."""

    ttl_seconds: float = 300.0
    max_entries: int = 10_000
    max_bytes: int = 64 * 1024 * 1024  # all stored answers of this router together
    max_entry_bytes: int = 4 * 1024 * 1024  # one answer; a larger one is served, not stored
    store: bool = True  # keep finished answers (exact match); false: deduplication only
    dedup: bool = True  # identical requests in flight share one engine call
    repeatable_only: bool = True  # only temperature 0 or a seed is cached or shared
    shared: bool = False  # tenants see each other's answers (off: the tenant is in the key)
    bill_hits: bool = True  # a cached or shared answer is billed in full (false: not at all)


CACHE_RANGES: Final[Mapping[str, tuple[float, float]]] = MappingProxyType(
    {
        "ttl_seconds": (0.001, 30 * 86400.0),
        "max_entries": (1, 10_000_000),
        "max_bytes": (1024, 1 << 40),
        "max_entry_bytes": (1024, 1 << 32),
    }
)


@dataclass(frozen=True, slots=True)
class SyntaxSettings:
    """`stream_validator.syntax`: which answers have their syntax judged, and which checks
    run (docs/validator.md). A request asks for structure with `response_format` JSON,
    Anthropic `output_format`, Responses `text.format` JSON, or by offering tools."""

    structured: bool = True  # judge answers to requests that ask for structure
    free_text: bool = False  # judge the other answers too (their events and any tool call)
    json: bool = True  # JSON asked for that can no longer become valid, or ends unfinished
    schema: bool = True  # a complete value that does not fit the requested schema
    tool_args: bool = True  # tool-call arguments that do not parse or fit the tool's schema
    events: bool = True  # engine events that are not SSE, or not JSON of the route's shape

    @property
    def any(self) -> bool:
        return (self.structured or self.free_text) and (
            self.json or self.schema or self.tool_args or self.events
        )


SYNTAX_OFF: Final = SyntaxSettings(structured=False)
SYNTAX_ALL: Final = SyntaxSettings(free_text=True)


@dataclass(frozen=True, slots=True)
class ValidatorSettings:
    """A policy's `stream_validator` block: how long a local stream is held back, what
    makes it degenerate, and which syntax checks run."""

    hold_chunks: int = 15  # chunks held before the first is released
    hold_ms: int = 1500  # ... or this long, whichever comes first
    ngram: int = 4  # words per n-gram when counting repeats
    max_repeat_fraction: float = 0.6  # repeated n-grams among all, above which it loops
    min_compression_ratio: float = 0.1  # compressed/raw size of the text below which it loops
    max_same_chunk: int = 8  # the same chunk text this many times in a row loops
    min_words: int = 12  # text shorter than this is never judged by the ratios
    after_hold: bool = True  # keep checking after the window; a failure then ends the stream
    syntax: SyntaxSettings = SyntaxSettings()


VALIDATOR_RANGES: Final[Mapping[str, tuple[float, float]]] = MappingProxyType(
    {
        "hold_chunks": (1, 10_000),
        "hold_ms": (1, 600_000),
        "ngram": (1, 64),
        "max_repeat_fraction": (0.0, 1.0),
        "min_compression_ratio": (0.0, 1.0),
        "max_same_chunk": (2, 100_000),
        "min_words": (1, 1_000_000),
    }
)


def check_ranges(
    block: str, ranges: Mapping[str, tuple[float, float]], value: object
) -> str | None:
    """The first field of `value` outside its inclusive range, as `<block>.<field>: <why>`."""
    for name, (low, high) in ranges.items():
        got = getattr(value, name)
        if isinstance(got, bool) or not isinstance(got, int | float):
            return f"{block}.{name}: must be a number"
        if not low <= got <= high:
            return f"{block}.{name}: must be between {low:g} and {high:g}"
    return None


def check_cache(s: CacheSettings) -> str | None:
    problem = check_ranges("response_cache", CACHE_RANGES, s)
    if problem is None and not (s.store or s.dedup):
        return "response_cache.store: store and dedup are both off; remove the block instead"
    if problem is None and s.max_entry_bytes > s.max_bytes:
        return "response_cache.max_entry_bytes: must not exceed max_bytes"
    return problem


def check_validator(s: ValidatorSettings) -> str | None:
    return check_ranges("stream_validator", VALIDATOR_RANGES, s)
