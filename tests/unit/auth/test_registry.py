from __future__ import annotations

import hashlib

import pytest

from hivenet_router.auth.registry import DynamicRegistry, RegistryError


def body(raw: str, version: str, **extra: object) -> dict[str, object]:
    return {
        "version": version,
        "key_hash": hashlib.sha256(raw.encode()).hexdigest(),
        "owner": "acme",
        "name": "prod",
        "enabled": True,
        **extra,
    }


def test_put_find_versions_and_delete() -> None:
    registry = DynamicRegistry()
    registry.put("k1", body("raw-1", "rev_02", allowed_models=["m"]))
    entry = registry.find("raw-1", 0)
    assert entry is not None and entry.id == "k1" and entry.models == frozenset({"m"})
    assert registry.find("raw-2", 0) is None
    with pytest.raises(RegistryError) as info:
        registry.put("k2", body("raw-2", "rev_01"))
    assert info.value.status == 409 and info.value.extra == {"current_version": "rev_02"}
    registry.put("k1", body("raw-1", "rev_02", enabled=False))  # equal version is fine
    assert registry.find("raw-1", 0) is None  # disabled
    with pytest.raises(RegistryError, match="already belongs to k1"):
        registry.put("k3", body("raw-1", "rev_03"))
    registry.delete("k1", "rev_03")
    registry.delete("k1", "rev_03")  # idempotent
    assert len(registry) == 0 and registry.version == "rev_03"
    with pytest.raises(RegistryError, match="version is required"):
        registry.delete("k1", None)


def test_expiry_and_validation() -> None:
    registry = DynamicRegistry()
    registry.put("k", body("raw", "1", expires_at="2027-01-01T00:00:00Z"))
    assert registry.find("raw", 1_798_761_599) is not None
    assert registry.find("raw", 1_798_761_600) is None
    for bad, needle in (
        ({"key_hash": "abc"}, "key_hash"),
        ({"owner": ""}, "owner: is required"),
        ({"enabled": "yes"}, "enabled"),
        ({"expires_at": "tomorrow"}, "RFC 3339"),
        ({"expires_at": "2027-01-01T00:00:00"}, "time zone"),
        ({"quota": {"requests_per_minute": -1}}, "an integer from 0 to"),
        ({"quota": {"tokens_per_day": 10**30}}, "tokens_per_day: must be an integer from 0 to"),
        ({"max_occupancy_share": 2}, "max_occupancy_share"),
        ({"colour": "red"}, "colour: unknown field"),
        # Found by a new user: a 200,000-character owner was taken, became a metric
        # label, and its tenant could never own a wallet.
        ({"owner": "o" * 201}, "owner: at most 200 printable characters"),
        ({"name": "line\nbreak"}, "name: at most 200 printable characters"),
    ):
        with pytest.raises(RegistryError, match=needle) as info:
            registry.put("x", {**body("other", "2"), **bad})
        assert info.value.status == 400
    assert registry.get("x") is None and registry.version == "1"  # nothing applied


def test_replace_is_atomic() -> None:
    registry = DynamicRegistry()
    registry.put("old", body("raw-old", "1"))
    count = registry.replace(
        {
            "version": "2",
            "keys": [{"id": "a", **body("raw-a", "2")}, {"id": "b", **body("raw-b", "2")}],
        }
    )
    assert count == 2 and registry.find("raw-old", 0) is None
    with pytest.raises(RegistryError, match="duplicate key hash"):
        registry.replace(
            {
                "version": "3",
                "keys": [{"id": "c", **body("same", "3")}, {"id": "d", **body("same", "3")}],
            }
        )
    with pytest.raises(RegistryError, match="duplicate id"):
        registry.replace(
            {"version": "3", "keys": [{"id": "c", **body("x", "3")}, {"id": "c", **body("y", "3")}]}
        )
    assert [e.id for e in registry.entries()] == ["a", "b"] and registry.version == "2"
    assert registry.entries()[0].public()["key_hash"] == ""  # never given back
