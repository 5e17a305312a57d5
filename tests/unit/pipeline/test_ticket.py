"""The ticket: per-stage state under keys, notes for the audit record in their places, the
caller after authentication and the policy snapshot."""

from __future__ import annotations

import pytest

from hivenet_router.auth.providers import ANONYMOUS
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.ticket import MAX_NOTES, Key, Note, Ticket
from hivenet_router.policy.document import BUILT_IN

AVOID = Key[frozenset[str]]("avoid", frozenset)
TRIES = Key[list[str]]("tries", list)
FIRST = Note[str]("first", place=10)
SECOND = Note[bool]("second", place=20)
THIRD = Note[int]("third", place=30)


def ticket() -> Ticket:
    return Ticket("rid", "/v1/chat/completions", 0.0, Observers())


def test_a_key_nobody_put_reads_its_default_and_stores_nothing() -> None:
    t = ticket()
    assert t.get(AVOID) == frozenset()
    tries = t.get(TRIES)
    tries.append("a")  # a mutable default changed in place is not kept: put it back
    assert t.get(TRIES) == []
    t.put(TRIES, tries)
    assert t.get(TRIES) == ["a"]


def test_keys_compare_by_identity_not_by_name() -> None:
    t = ticket()
    twin = Key[frozenset[str]]("avoid", frozenset)
    t.put(AVOID, frozenset({"x"}))
    assert t.get(AVOID) == frozenset({"x"}) and t.get(twin) == frozenset()
    t.put(twin, frozenset({"y"}))
    assert t.get(AVOID) == frozenset({"x"})
    assert repr(AVOID) == "Key('avoid')"


def test_a_falsy_value_put_is_kept() -> None:
    flag = Key[bool]("flag", lambda: True)
    t = ticket()
    t.put(flag, False)
    assert t.get(flag) is False


def test_notes_come_out_in_their_places_whenever_they_were_left() -> None:
    t = ticket()
    assert t.notes() == []
    t.note(THIRD, 3)
    t.note(FIRST, "a")
    t.note(SECOND, False)
    assert t.notes() == [("first", "a"), ("second", False), ("third", 3)]
    t.note(FIRST, "b")  # replaced in its place
    t.note(SECOND, None)  # taken back
    assert t.notes() == [("first", "b"), ("third", 3)]
    assert t.noted(FIRST) == "b" and t.noted(SECOND) is None
    t.note(SECOND, None)  # taking back what is not there is nothing
    assert ticket().noted(FIRST) is None


def test_notes_are_bounded() -> None:
    t = ticket()
    many = [Note[int](f"n{i}", place=i) for i in range(MAX_NOTES + 1)]
    for i, note in enumerate(many):
        t.note(note, i)
    assert len(t.notes()) == MAX_NOTES and t.noted(many[-1]) is None
    t.note(many[0], 99)  # one already there may still change
    assert t.noted(many[0]) == 99


def test_the_caller_is_there_only_once_authenticated() -> None:
    t = ticket()
    with pytest.raises(RuntimeError, match="rid has no authenticated caller"):
        _ = t.caller
    t.principal = ANONYMOUS
    assert t.caller is ANONYMOUS


def test_the_policy_is_the_built_in_one_until_the_model_is_known() -> None:
    assert ticket().policy is BUILT_IN
