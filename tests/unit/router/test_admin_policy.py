"""GET /admin/policy shows each step's strategy options, in a shape a PUT takes back."""

from __future__ import annotations

import orjson
import pytest

from hivenet_router.policy.document import parse_policy
from hivenet_router.router.admin_policy import policy_json

STEPS = [
    "{strategy: least-loaded}",
    "{strategy: prefix-affinity, affinity: {min_match: 0.3, max_imbalance: 4}}",
    "{strategy: consistent-hash, hash: {key: prefix, load_factor: 2}}",
    "{strategy: scored, scoring: {preset: latency-first, weights: {ttft: 2}, temperature: 0.5,"
    " costs: [{match: {region: EU, tags: [gpu]}, usd_per_million_tokens: 0.2}]}}",
    "{strategy: predicted-latency, prediction: {ttft_objective_ms: 1e3, max_imbalance: 3}}",
    "{strategy: predicted-latency}",
]


@pytest.mark.parametrize("step", STEPS)
def test_the_options_in_force_are_shown_and_read_back_the_same(step: str) -> None:
    policy = parse_policy(f"routing_policy: {step}\n", "p.yaml", "p", require_models=False)
    shown = policy_json(policy)["routing_policy"]
    blocks = {"affinity", "hash", "scoring", "prediction"}
    strategy = policy.steps[0].strategy
    assert len(blocks & set(shown)) == (0 if strategy == "least-loaded" else 1), shown
    # The JSON shown, put back as a document (JSON is YAML), gives the same options.
    document = {"routing_policy": {k: v for k, v in shown.items() if k != "name" and v is not None}}
    again = parse_policy(orjson.dumps(document).decode(), "body", "p", require_models=False)
    assert again.steps[0].options == policy.steps[0].options
    assert again.steps[0].strategy == strategy


def test_an_objective_in_force_can_be_seen() -> None:
    text = "routing_policy: {strategy: predicted-latency, prediction: {ttft_objective_ms: 250}}\n"
    shown = policy_json(parse_policy(text, "p.yaml", "p", require_models=False))
    assert shown["routing_policy"]["prediction"] == {"max_imbalance": 8, "ttft_objective_ms": 250.0}
