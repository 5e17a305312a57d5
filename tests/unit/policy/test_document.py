from __future__ import annotations

import pytest

from hivenet_router.domain.agent import EngineSnapshot, HardwareSnapshot
from hivenet_router.policy.document import parse_policy
from hivenet_router.policy.reader import PolicyError
from tests.unit.policy.agents import Agent, agent

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
        ("routing_policy:\n  strategy: random\n", "unknown strategy 'random'"),
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
        # Tags the safe loader refuses or cannot apply, and numbers no gate can compare.
        (
            "routing_policy:\n  strategy: least-loaded\n  max_tries: !!int two\n",
            "p.yaml:3: routing_policy.max_tries: is not a plain value",
        ),
        (
            "routing_policy:\n  strategy: !!python/name:os.system x\n",
            "p.yaml:2: routing_policy.strategy: is not a plain value",
        ),
        (
            "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n"
            "    kv_cache_utilization: {gt: .nan}\n",
            "kv_cache_utilization.gt: must be a finite number",
        ),
        (
            "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n"
            f"    srtt: {{gt: {'9' * 400}}}\n",
            "srtt.gt: must be a finite number",
        ),
        (
            f"routing_policy: {{strategy: least-loaded}}\nmax_inflight: {'9' * 400}\n",
            "max_inflight: is out of range",
        ),
        (
            "routing_policy: {strategy: least-loaded}\nshed_if:\n  waiting_requests: {gt: .inf}\n",
            "waiting_requests.gt: must be a finite number",
        ),
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


def test_a_step_matches_an_engine_by_the_name_agents_register() -> None:
    """Found by a new user: `engine: llama-cpp` (a name --engine takes) matched no agent,
    which registers as llamacpp, and every request was refused; a typo loaded silently."""
    text = "routing_policy:\n  match: {engine: Llama-CPP}\n  strategy: least-loaded\n"
    step = parse_policy(text, "p.yaml", "p", require_models=False).steps[0]
    assert step.match.accepts(agent(engine="llamacpp"))
    with pytest.raises(PolicyError, match=r"match.engine: unknown engine \(known: vllm"):
        parse_policy(text.replace("Llama-CPP", "lamacpp"), "p.yaml", "p", require_models=False)


def test_serverless_mode_is_accepted() -> None:
    policy = parse_policy(
        "mode: serverless\nrouting_policy: {strategy: least-loaded}\n",
        "p.yaml",
        "p",
        require_models=False,
    )
    assert policy.mode == "serverless"


@pytest.mark.parametrize("written", ["2.5e2", "250e0", "2.5E+2", "25000e-2"])
def test_a_number_with_an_exponent_is_a_number(written: str) -> None:
    """JSON writes numbers with an exponent (Python's json.dumps(0.00001) is `1e-05`), and
    the policy API takes JSON as YAML, whose 1.1 rules read `1e3` as a string."""
    text = (
        "routing_policy:\n  strategy: predicted-latency\n"
        f"  prediction: {{ttft_objective_ms: {written}}}\n"
    )
    step = parse_policy(text, "p.yaml", "p", require_models=False).steps[0]
    assert step.options.ttft_objective_ms == 250.0
    quoted = text.replace(written, f'"{written}"')  # a string stays a string
    with pytest.raises(PolicyError, match=r"p\.yaml:3: .*ttft_objective_ms: must be a number"):
        parse_policy(quoted, "p.yaml", "p", require_models=False)


@pytest.mark.parametrize("opening", ["[", "{a: ", "- "])
def test_a_document_nested_too_deeply_is_a_policy_error(opening: str) -> None:
    """1,000 levels in 2 KB answered PUT /admin/policy with a 500 and 3,000 lines of
    traceback (found by a new user)."""
    with pytest.raises(PolicyError, match="nested too deeply"):
        parse_policy(opening * 3000, "body", "p", require_models=False)


def test_a_field_left_empty_names_what_it_needs() -> None:
    """`default_max_tokens:` with nothing after it read "is not a plain value (while
    parsing a block node)" (noticed by a new user)."""
    with pytest.raises(PolicyError, match=r"p\.yaml:1: default_max_tokens: must be an integer$"):
        parse_policy(
            "default_max_tokens:\nrouting_policy: {strategy: least-loaded}\n",
            "p.yaml",
            "p",
            require_models=False,
        )
