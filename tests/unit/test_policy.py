from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hivenet_router.domain.agent import EngineSnapshot, HardwareSnapshot, Registration
from hivenet_router.policy.document import PolicyError, parse_policy
from hivenet_router.policy.store import PolicyStore
from hivenet_router.policy.strategies import STRATEGIES
from hivenet_router.router.history import smooth_rtt

FULL = """\
models: [m1, m2]
mode: reserved
max_input_tokens: 1000
admit_budget_tokens: 5000
max_inflight: 4
shed_if:
  kv_cache_utilization: {gt: 0.9}
routing_policy:
  match:
    region: eu
    engine: vllm
    tags: [production]
  exclude_if:
    kv_cache_utilization: {gt: 0.85}
    success_rate: {lt: 0.95}
    memory_used_percent: {gte: 0.9}
  strategy: least-loaded
  max_tries: 2
fallback_chain:
  - name: anywhere
    match: {}
    strategy: least-loaded
  - strategy: least-loaded
    max_tries: 1
fallback_provider:
  engine: openai
  model: gpt-4o-mini
"""


@dataclass
class Agent:
    reg: Registration
    active: int = 0
    engine: EngineSnapshot | None = None
    hardware: HardwareSnapshot | None = None
    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    srtt_ms: float | None = None
    last_assigned: int = field(default=0)


def agent(
    region: str = "eu",
    engine: str = "vllm",
    tags: tuple[str, ...] = ("production",),
    **state: object,
) -> Agent:
    reg = Registration(
        peer_id="p",
        model="m1",
        capability="llm",
        engine=engine,
        capacity=4,
        region=region,
        tags=list(tags),
    )
    return Agent(reg, **state)  # type: ignore[arg-type]


def test_a_full_document() -> None:
    policy = parse_policy(FULL, "p.yaml", "p", require_models=True)
    assert policy.models == ("m1", "m2")
    assert [s.name for s in policy.steps] == ["primary", "anywhere", "fallback-2"]
    assert policy.steps[0].max_tries == 2 and policy.steps[1].max_tries is None
    assert policy.fallback_provider is not None and policy.fallback_provider.engine == "openai"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("routing_policy: {strategy: least-loaded}\nbogus: 1\n", "p.yaml:2: policy.bogus: unknown"),
        ("routing_policy:\n  match: {}\n", "routing_policy.strategy: is required"),
        ("routing_policy:\n  strategy: round-robin\n", "unknown strategy 'round-robin'"),
        (
            "routing_policy:\n  strategy: least-loaded\n  max_tries: -1\n",
            "p.yaml:3: routing_policy.max_tries: must not be negative",
        ),
        ("routing_policy:\n  strategy: least-loaded\n  max_tries: three\n", "must be an integer"),
        (
            "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n    sucess_rate: {lt: 1}\n",
            "p.yaml:4: routing_policy.exclude_if.sucess_rate: unknown signal",
        ),
        (
            "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n"
            "    success_rate: {lt: 0.9, gt: 0.1}\n",
            "exactly one of gt, gte, lt, lte",
        ),
        (
            "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n    success_rate: {}\n",
            "exactly one of",
        ),
        (
            "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n"
            "    success_rate: {lt: high}\n",
            "must be a number",
        ),
        (
            "routing_policy:\n  strategy: least-loaded\n  match:\n    colour: red\n",
            "routing_policy.match.colour: unknown field",
        ),
        (
            "routing_policy:\n  strategy: least-loaded\n  match:\n    tags: production\n",
            "must be a list of strings",
        ),
        (
            "routing_policy: {strategy: least-loaded}\nfallback_chain: []\n",
            "fallback_chain: must be a non-empty list",
        ),
        ("routing_policy: {strategy: least-loaded}\nmax_inflight: -4\n", "must not be negative"),
        ("routing_policy: {strategy: least-loaded}\nmode: burst\n", "mode: must be one of"),
        (
            "routing_policy: {strategy: least-loaded}\nshed_if:\n  srtt: {gt: 5}\n",
            "shed_if.srtt: unknown signal",
        ),
        (
            "routing_policy: {strategy: least-loaded}\n"
            "fallback_provider: {engine: gemini, model: x}\n",
            "fallback_provider.engine: must be one of",
        ),
        (
            "routing_policy: {strategy: least-loaded}\nfallback_provider: {engine: openai}\n",
            "fallback_provider.model: is required",
        ),
        ("routing_policy: [1, 2\n", "not valid YAML"),
        ("", "empty policy document"),
        (
            "routing_policy: {strategy: least-loaded}\nrouting_policy: {strategy: least-loaded}\n",
            "appears twice",
        ),
    ],
)
def test_validation_errors_name_file_line_and_field(text: str, needle: str) -> None:
    with pytest.raises(PolicyError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_policy(text, "p.yaml", "p", require_models=False)


def test_named_documents_need_models() -> None:
    with pytest.raises(PolicyError, match="at least one model"):
        parse_policy(
            "routing_policy: {strategy: least-loaded}\n", "x.yaml", "x", require_models=True
        )


def test_match_and_gates() -> None:
    step = parse_policy(FULL, "p.yaml", "p", require_models=False).steps[0]
    assert step.match.accepts(agent())
    assert step.match.accepts(agent(tags=("production", "gpu")))
    assert not step.match.accepts(agent(region="EU"))  # exact and case-sensitive
    assert not step.match.accepts(agent(tags=("staging",)))
    assert not step.match.accepts(agent(engine="sglang"))
    # Missing signals pass; present ones are compared.
    assert step.excluded_by(agent()) is None
    hot = Agent(agent().reg, engine=EngineSnapshot(kv_cache_utilization=0.9))
    gate = step.excluded_by(hot)
    assert gate is not None and gate.signal == "kv_cache_utilization"
    flaky = agent(successes=90, failures=10)
    assert step.excluded_by(flaky) is not None
    fresh = agent(successes=0, failures=0)
    assert step.excluded_by(fresh) is None  # no history yet: the gate is skipped
    # Hardware arrives in percent and is compared as a fraction.
    busy = agent(hardware=HardwareSnapshot(memory_used_percent=95.0))
    assert step.excluded_by(busy) is not None
    calm = agent(hardware=HardwareSnapshot(memory_used_percent=50.0))
    assert step.excluded_by(calm) is None


def test_least_loaded_skips_full_agents() -> None:
    strategy = STRATEGIES["least-loaded"]
    full = agent(active=4)
    light = agent(active=1, last_assigned=5)
    lighter = agent(active=1, last_assigned=2)
    assert strategy.pick([full, light, lighter]) is lighter
    assert strategy.pick([full]) is None


def test_rtt_smoothing_follows_rfc_6298() -> None:
    srtt, rttvar = smooth_rtt(None, None, 100.0)
    assert (srtt, rttvar) == (100.0, 50.0)
    srtt, rttvar = smooth_rtt(srtt, rttvar, 200.0)
    assert rttvar == pytest.approx(0.75 * 50 + 0.25 * 100)
    assert srtt == pytest.approx(0.875 * 100 + 0.125 * 200)


def _write(path: Path, text: str, mtime: float) -> None:
    path.write_text(text)
    os.utime(path, (mtime, mtime))


def test_directory_loading_and_conservative_reload(tmp_path: Path) -> None:
    base = "routing_policy: {strategy: least-loaded, max_tries: 1}\n"
    _write(tmp_path / "_default.yaml", base, 100)
    _write(tmp_path / "older.yaml", "models: [a, shared]\n" + base, 200)
    _write(tmp_path / "newer.yaml", "models: [b, shared]\n" + base, 300)
    (tmp_path / "notes.txt").write_text("ignored")
    store = PolicyStore(model_dir=str(tmp_path))
    store.load()
    current = store.current
    assert current.default.name == "_default"
    assert set(current.named) == {"older"}  # newer clashes on "shared"
    assert current.for_model("shared").name == "older"
    assert current.for_model("b").name == "_default"  # the whole clashing file is skipped
    # On reload, an invalid new file is skipped, a valid file that turns invalid keeps its
    # previous version, and a deleted one goes away.
    _write(tmp_path / "nomodels.yaml", base, 400)
    _write(tmp_path / "broken.yml", "models: [c]\nrouting_policy: {}\n", 500)
    assert store.reload()
    assert set(store.current.named) == {"older"}
    snapshot = store.current
    _write(tmp_path / "older.yaml", "models: [a]\nrouting_policy: {strategy: nope}\n", 600)
    _write(tmp_path / "broken.yml", "models: [c]\n" + base, 700)
    assert store.reload()
    assert store.current.named["older"] is snapshot.named["older"]
    assert store.current.for_model("c").name == "broken"
    assert snapshot.for_model("c").name == "_default"  # in-flight snapshots are untouched
    (tmp_path / "broken.yml").unlink()
    _write(tmp_path / "_default.yaml", "routing_policy: {}\n", 800)
    assert store.reload()
    assert "broken" not in store.current.named
    assert store.current.default.name == "_default"  # invalid default: previous one kept


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("nomodels.yaml", "routing_policy: {strategy: least-loaded}\n", "at least one model"),
        ("broken.yml", "models: [c]\nrouting_policy: {}\n", "strategy: is required"),
    ],
)
def test_an_invalid_per_model_policy_is_fatal_at_start(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    """Skipping it would serve its models under the global policy without anyone noticing."""
    _write(tmp_path / "_default.yaml", "routing_policy: {strategy: least-loaded}\n", 100)
    _write(tmp_path / name, text, 200)
    with pytest.raises(PolicyError, match=message) as info:
        PolicyStore(model_dir=str(tmp_path)).load()
    assert name in str(info.value)


def test_a_configuration_check_can_refuse_a_policy_set(tmp_path: Path) -> None:
    _write(tmp_path / "_default.yaml", "routing_policy: {strategy: least-loaded}\n", 100)
    store = PolicyStore(model_dir=str(tmp_path))
    store.check = lambda candidate: "no" if candidate.default.mode == "serverless" else None
    store.load()
    first = store.current
    _write(
        tmp_path / "_default.yaml",
        "mode: serverless\nrouting_policy: {strategy: least-loaded}\n",
        200,
    )
    assert not store.reload()
    assert store.current is first
    with pytest.raises(PolicyError, match="no"):
        _refusing_load(tmp_path)


def _refusing_load(path: Path) -> None:
    store = PolicyStore(model_dir=str(path))
    store.check = lambda candidate: "no"
    store.load()


def test_invalid_global_policy_is_fatal_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text("routing_policy: {strategy: nope}\n")
    with pytest.raises(PolicyError, match="unknown strategy"):
        PolicyStore(policy_file=str(bad)).load()
    with pytest.raises(PolicyError, match="cannot read"):
        PolicyStore(policy_file=str(tmp_path / "missing.yaml")).load()


def test_serverless_mode_is_accepted() -> None:
    policy = parse_policy(
        "mode: serverless\nrouting_policy: {strategy: least-loaded}\n",
        "p.yaml",
        "p",
        require_models=False,
    )
    assert policy.mode == "serverless"
