"""Policy documents: parse YAML strictly and say exactly what is wrong.

Unknown keys, wrong types, negative limits, empty chains, unknown signals and operators are
errors naming the file, the line and the field (`policy.yaml:14: routing_policy.exclude_if.
sucess_rate: unknown signal ...`). The accepted shape is also published as a JSON Schema
(docs/policy.schema.json) for editors.

This module reads routing's own fields. A section another layer owns is a `Block` handed in
by the caller (`policy/blocks.py`): parsed after routing's fields, in the order the blocks
are given, and kept in `Policy.blocks`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import yaml

from hivenet_router.domain.agent import ENGINES, engine_name
from hivenet_router.policy import options as step_options
from hivenet_router.policy.blocks import Block, check_names
from hivenet_router.policy.gates import OPERATORS, ThresholdGate
from hivenet_router.policy.plugins import Strategy
from hivenet_router.policy.reader import PolicyError, Reader
from hivenet_router.policy.signals import SHED_SIGNALS, SIGNALS, AgentFacts
from hivenet_router.policy.strategies import NAMES, Options, build
from hivenet_router.routing.breaker import BreakerSettings
from hivenet_router.routing.breaker import check_settings as check_breaker
from hivenet_router.routing.vegas import VegasSettings
from hivenet_router.routing.vegas import check_settings as check_vegas

T = TypeVar("T")
MATCH_FIELDS = ("region", "engine", "organization", "machine", "gpu_model", "deployment_id")
STEP_FIELDS = (
    "name",
    "match",
    "exclude_if",
    "strategy",
    "max_tries",
    *step_options.BLOCKS,
)
TOP_FIELDS = (
    "models",
    "mode",
    "max_input_tokens",
    "images_max",
    "admit_budget_tokens",
    "max_inflight",
    "default_max_tokens",
    "min_output_tokens",
    "shed_if",
    "routing_policy",
    "fallback_chain",
    "fallback_provider",
    "circuit_breaker",
    "adaptive_concurrency",
)
PROVIDERS = ("openai", "anthropic")
DEFAULT_MAX_TOKENS = 4096
MODES = ("reserved", "serverless")


@dataclass(frozen=True, slots=True)
class Match:
    fields: tuple[tuple[str, str], ...] = ()
    tags: tuple[str, ...] = ()

    def accepts(self, agent: AgentFacts) -> bool:
        if not self.fields and not self.tags:
            return True  # the common `match: {}`: nothing to check on the hot path
        reg = agent.reg
        for name, wanted in self.fields:
            if getattr(reg, name) != wanted:
                return False
        return all(tag in reg.tags for tag in self.tags)


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    match: Match
    gates: tuple[ThresholdGate, ...]
    strategy: str
    max_tries: int | None  # None: the router-wide --max-tries-per-step
    options: Options = Options()
    # What the executor runs: built once from strategy and options when the policy is read.
    plan: Strategy = field(default=build("least-loaded", Options()), compare=False)

    def excluded_by(self, agent: AgentFacts) -> ThresholdGate | None:
        for gate in self.gates:
            if gate.excludes(agent):
                return gate
        return None


@dataclass(frozen=True, slots=True)
class Provider:
    engine: str
    model: str


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    models: tuple[str, ...]
    steps: tuple[Step, ...]  # the primary routing_policy first, then the fallback chain
    mode: str = "reserved"
    max_input_tokens: int = 0
    images_max: int = 0
    admit_budget_tokens: int = 0
    max_inflight: int = 0
    # The output bound held and forwarded when a request declares none (0: none, the
    # reference's behaviour), and the least bound worth sending a request out with.
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    min_output_tokens: int = 1
    shed_if: tuple[ThresholdGate, ...] = ()
    fallback_provider: Provider | None = None
    breaker: BreakerSettings = BreakerSettings()
    adaptive: VegasSettings = VegasSettings()
    source: str = "built-in"
    # What the blocks handed to the parser read, by block name, for those in the document.
    blocks: tuple[tuple[str, object], ...] = ()

    def block(self, block: Block[T]) -> T:
        """What `block` parsed from this policy's document, or its default."""
        for name, value in self.blocks:
            if name == block.name:
                return cast("T", value)
        return block.default()

    def with_block(self, block: Block[T], value: T) -> Policy:
        """This policy with `value` as what `block` holds (tests and built policies)."""
        kept = tuple((name, held) for name, held in self.blocks if name != block.name)
        return dataclasses.replace(self, blocks=(*kept, (block.name, value)))


BUILT_IN = Policy(
    name="built-in",
    models=(),
    steps=(Step("primary", Match(), (), "least-loaded", None),),
)


class RoutingReader(Reader):
    """The reader with routing's own sections: steps, their match and their gates."""

    def gates(
        self, node: yaml.Node, path: str, allowed: tuple[str, ...]
    ) -> tuple[ThresholdGate, ...]:
        gates = []
        for signal, rule in self.mapping(node, path, ()).items():
            where = f"{path}.{signal}"
            if signal not in allowed:
                raise self.fail(rule, where, f"unknown signal (known: {', '.join(allowed)})")
            ops = self.mapping(rule, where, tuple(OPERATORS))
            if len(ops) != 1:
                raise self.fail(rule, where, "needs exactly one of gt, gte, lt, lte")
            ((op, threshold),) = ops.items()
            gates.append(ThresholdGate(signal, op, self.number(threshold, f"{where}.{op}")))
        return tuple(gates)

    def match(self, node: yaml.Node, path: str) -> Match:
        fields: list[tuple[str, str]] = []
        tags: tuple[str, ...] = ()
        for key, value in self.mapping(node, path, (*MATCH_FIELDS, "tags")).items():
            if key == "tags":
                tags = self.strings(value, f"{path}.tags")
            else:
                text = self.string(value, f"{path}.{key}")
                if key == "engine" and text:
                    # Agents register one name an engine (llama-cpp as llamacpp): a policy
                    # naming another matched no agent and served nothing, silently.
                    known = engine_name(text)
                    if known is None:
                        raise self.fail(
                            value, f"{path}.engine", f"unknown engine (known: {', '.join(ENGINES)})"
                        )
                    text = known
                if text:
                    fields.append((key, text))
        return Match(tuple(fields), tags)

    def provider(self, node: yaml.Node, path: str) -> Provider:
        fields = self.mapping(node, path, ("engine", "model"))
        for required in ("engine", "model"):
            if required not in fields:
                raise self.fail(node, f"{path}.{required}", "is required")
        engine = self.string(fields["engine"], f"{path}.engine")
        if engine not in PROVIDERS:
            raise self.fail(
                fields["engine"], f"{path}.engine", f"must be one of {', '.join(PROVIDERS)}"
            )
        return Provider(engine, self.string(fields["model"], f"{path}.model", allow_empty=False))

    def step(self, node: yaml.Node, path: str, default_name: str) -> Step:
        items = self.mapping(node, path, STEP_FIELDS)
        if "strategy" not in items:
            raise self.fail(node, f"{path}.strategy", "is required")
        strategy = self.string(items["strategy"], f"{path}.strategy")
        if strategy not in NAMES:
            raise self.fail(
                items["strategy"],
                f"{path}.strategy",
                f"unknown strategy {strategy!r} (known: {', '.join(NAMES)})",
            )
        options = step_options.parse(self, items, path, strategy)
        tries = self.count(items["max_tries"], f"{path}.max_tries") if "max_tries" in items else 0
        return Step(
            name=self.string(items["name"], f"{path}.name", allow_empty=False)
            if "name" in items
            else default_name,
            match=self.match(items["match"], f"{path}.match") if "match" in items else Match(),
            gates=self.gates(items["exclude_if"], f"{path}.exclude_if", tuple(SIGNALS))
            if "exclude_if" in items
            else (),
            strategy=strategy,
            max_tries=tries or None,
            options=options,
            plan=build(strategy, options),
        )


def parse_policy(
    text: str,
    source: str,
    name: str,
    *,
    require_models: bool,
    blocks: Sequence[Block[Any]] = (),
) -> Policy:
    """One policy document; `blocks` are the other layers' sections it may carry."""
    reader = RoutingReader(source)
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise PolicyError(
            f"{source}{line}: not valid YAML: {getattr(exc, 'problem', exc)}"
        ) from None
    except RecursionError:
        # A 2 KB document of 1,000 nested brackets: PyYAML follows nesting on the stack.
        raise PolicyError(f"{source}: nested too deeply") from None
    if root is None:
        raise PolicyError(f"{source}: empty policy document")
    items = reader.mapping(root, "policy", (*TOP_FIELDS, *check_names(blocks, TOP_FIELDS)))
    models: tuple[str, ...] = ()
    if "models" in items:
        models = reader.strings(items["models"], "models")
    if require_models and not models:
        raise reader.fail(root, "models", "a named policy must list at least one model")
    if "routing_policy" not in items:
        raise reader.fail(root, "routing_policy", "is required")
    steps = [reader.step(items["routing_policy"], "routing_policy", "primary")]
    if "fallback_chain" in items:
        chain = items["fallback_chain"]
        if not isinstance(chain, yaml.SequenceNode) or not chain.value:
            raise reader.fail(chain, "fallback_chain", "must be a non-empty list of steps")
        for index, step in enumerate(chain.value):
            steps.append(reader.step(step, f"fallback_chain[{index}]", f"fallback-{index + 1}"))
    mode = reader.string(items["mode"], "mode") if "mode" in items else "reserved"
    if mode not in MODES:
        raise reader.fail(items["mode"], "mode", f"must be one of {', '.join(MODES)}")
    provider = None
    if "fallback_provider" in items:
        provider = reader.provider(items["fallback_provider"], "fallback_provider")
    limits: dict[str, Any] = {
        key: reader.count(items[key], key)
        for key in (
            "max_input_tokens",
            "images_max",
            "admit_budget_tokens",
            "max_inflight",
            "default_max_tokens",
            "min_output_tokens",
        )
        if key in items
    }
    shed = reader.gates(items["shed_if"], "shed_if", SHED_SIGNALS) if "shed_if" in items else ()
    tuning: dict[str, Any] = {}
    if "circuit_breaker" in items:
        tuning["breaker"] = reader.settings(
            items["circuit_breaker"],
            "circuit_breaker",
            BreakerSettings,
            check_breaker,
            step_options.complete_breaker,
        )
    if "adaptive_concurrency" in items:
        tuning["adaptive"] = reader.settings(
            items["adaptive_concurrency"],
            "adaptive_concurrency",
            VegasSettings,
            check_vegas,
            step_options.complete_vegas,
        )
    return Policy(
        name=name,
        models=models,
        steps=tuple(steps),
        mode=mode,
        shed_if=shed,
        fallback_provider=provider,
        source=source,
        **limits,
        **tuning,
        blocks=tuple(
            (block.name, block.parse(reader, items[block.name], block.name))
            for block in blocks
            if block.name in items
        ),
    )
