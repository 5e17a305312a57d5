from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from hivenet_router.policy.document import parse_policy
from hivenet_router.policy.reader import PolicyError
from hivenet_router.policy.schema import policy_schema
from hivenet_router.router.wiring import POLICY_BLOCKS

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "docs/examples/policies").glob("*.yaml"))


def test_the_schema_is_valid_and_published() -> None:
    schema = policy_schema(POLICY_BLOCKS)
    jsonschema.Draft202012Validator.check_schema(schema)
    published = Path(__file__).resolve().parents[3] / "docs/policy.schema.json"
    assert json.loads(published.read_text()) == schema


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_documented_examples_load_and_validate(path: Path) -> None:
    text = path.read_text()
    jsonschema.validate(yaml.safe_load(text), policy_schema(POLICY_BLOCKS))
    policy = parse_policy(
        text, str(path), path.stem, require_models=path.stem != "_default", blocks=POLICY_BLOCKS
    )
    assert policy.steps


@pytest.mark.parametrize(
    "text",
    [
        "routing_policy: {strategy: random}\n",
        "routing_policy: {strategy: least-loaded, exclude_if: {sucess_rate: {lt: 1}}}\n",
        "routing_policy: {strategy: least-loaded, exclude_if: {srtt: {lt: 1, gt: 2}}}\n",
        "routing_policy: {strategy: least-loaded}\nextra: 1\n",
        "routing_policy: {strategy: least-loaded, max_tries: -1}\n",
        "routing_policy: {strategy: least-loaded}\nfallback_chain: []\n",
    ],
)
def test_schema_and_loader_reject_the_same_mistakes(text: str) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(yaml.safe_load(text), policy_schema(POLICY_BLOCKS))
    with pytest.raises(PolicyError):
        parse_policy(text, "x.yaml", "x", require_models=False, blocks=POLICY_BLOCKS)
