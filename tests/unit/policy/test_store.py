from __future__ import annotations

import os
from pathlib import Path

import pytest

from hivenet_router.policy.reader import PolicyError
from hivenet_router.policy.store import PolicyStore


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
    # A reload that rejected a file says so (POST /admin/reload answers 409), though the
    # other files' changes took effect.
    assert not store.reload()
    assert set(store.current.named) == {"older"}
    snapshot = store.current
    _write(tmp_path / "older.yaml", "models: [a]\nrouting_policy: {strategy: nope}\n", 600)
    _write(tmp_path / "broken.yml", "models: [c]\n" + base, 700)
    assert not store.reload()
    assert store.current.named["older"] is snapshot.named["older"]
    assert store.current.for_model("c").name == "broken"
    assert snapshot.for_model("c").name == "_default"  # in-flight snapshots are untouched
    (tmp_path / "broken.yml").unlink()
    _write(tmp_path / "_default.yaml", "routing_policy: {}\n", 800)
    assert not store.reload()
    assert "broken" not in store.current.named
    assert store.current.default.name == "_default"  # invalid default: previous one kept
    (tmp_path / "nomodels.yaml").unlink()
    _write(tmp_path / "_default.yaml", base, 900)
    _write(tmp_path / "older.yaml", "models: [a]\n" + base, 1000)
    assert store.reload()  # every file valid again: all took effect
    assert store.current.for_model("a").name == "older"


def test_an_edit_that_claims_another_files_model_keeps_the_previous_version(
    tmp_path: Path,
) -> None:
    base = "routing_policy: {strategy: least-loaded}\n"
    _write(tmp_path / "a.yaml", "models: [m]\n" + base, 100)
    _write(tmp_path / "b.yaml", "models: [n]\n" + base, 200)
    store = PolicyStore(model_dir=str(tmp_path))
    store.load()
    before = store.current.named["a"]
    _write(tmp_path / "a.yaml", "models: [m, n]\n" + base, 300)  # a now claims b's model
    assert not store.reload()
    assert store.current.named["a"] is before  # m stays under a, not the global policy
    assert store.current.for_model("m").name == "a"
    assert store.current.for_model("n").name == "b"
    # A tag the YAML loader cannot apply is an invalid file like any other, not a crash.
    _write(tmp_path / "b.yaml", "models: [n]\nrouting_policy: {strategy: !!int x}\n", 400)
    assert not store.reload()
    assert store.current.for_model("n").name == "b"


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


def test_a_policy_file_that_is_not_utf8_is_refused_and_the_old_set_kept(
    tmp_path: Path,
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("routing_policy: {strategy: least-loaded}\n")
    store = PolicyStore(policy_file=str(path))
    store.load()
    before = store.current
    path.write_bytes(b"# caf\xe9\nrouting_policy: {strategy: least-loaded}\n")
    store.reload()  # logged, and the global policy kept as it was
    assert store.current.default is before.default
    with pytest.raises(PolicyError, match="not UTF-8"):
        PolicyStore(policy_file=str(path)).load()
