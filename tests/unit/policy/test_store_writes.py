"""Policies written through the admin API: validated like files, held in memory until a
reload rebuilds the set from the files."""

from __future__ import annotations

from pathlib import Path

import pytest

from hivenet_router.policy.reader import PolicyError
from hivenet_router.policy.store import PolicyConflict, PolicyStore

BASE = "routing_policy: {strategy: least-loaded}\n"


def test_replace_the_global_policy_until_reload(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(BASE)
    store = PolicyStore(policy_file=str(path))
    store.load()
    text = "routing_policy: {strategy: least-loaded, max_tries: 2}\n"
    store.replace_default(store.parse(text, "body", "global", named=False))
    assert store.current.default.steps[0].max_tries == 2
    assert store.reload()
    assert store.current.default.steps[0].max_tries is None


def test_a_document_is_checked_as_a_file_is() -> None:
    store = PolicyStore()
    with pytest.raises(PolicyError, match=r"body:1: routing_policy\.strategy: unknown strategy"):
        store.parse("routing_policy: {strategy: fastest}\n", "body", "g", named=False)
    with pytest.raises(PolicyError, match="models: a named policy must list at least one model"):
        store.parse(BASE, "body", "n", named=True)
    with pytest.raises(PolicyError, match=r"fallback_provider\.engine: openai needs"):
        store.parse(
            BASE + "fallback_provider: {engine: openai, model: gpt}\n", "body", "g", named=False
        )


def test_named_policies_claim_models_once() -> None:
    store = PolicyStore()
    store.put_named(store.parse("models: [a, b]\n" + BASE, "body", "one", named=True))
    with pytest.raises(PolicyConflict, match="models: b already claimed by policy one"):
        store.put_named(store.parse("models: [b, c]\n" + BASE, "body", "two", named=True))
    assert set(store.current.named) == {"one"}
    # Replacing a policy under its own name may drop and take models.
    store.put_named(store.parse("models: [b, c]\n" + BASE, "body", "one", named=True))
    assert store.current.for_model("a").name == "built-in"
    assert store.current.for_model("c").name == "one"
    assert store.delete_named("one") and not store.delete_named("one")
    assert store.current.for_model("b").name == "built-in" and store.current.named == {}


def test_the_keys_may_refuse_a_write() -> None:
    store = PolicyStore()
    store.check = lambda candidate: "key k: too small" if candidate.named else None
    before = store.current
    with pytest.raises(PolicyConflict, match="key k: too small"):
        store.put_named(store.parse("models: [a]\n" + BASE, "body", "one", named=True))
    assert store.current is before
