"""Discovery's bookkeeping: which routers get a session, which session closes, and when."""

from __future__ import annotations

import pytest

from hivenet_router.agent import discovery
from hivenet_router.agent.discovery import Listed, RouterBook, Verdict, identity, parse_routers
from hivenet_router.config.values import ListenAddress

PEER = "12D3KooWsite"  # every router of a site derives the same key, so the same peer ID


def at(text: str) -> ListenAddress:
    host, _, port = text.rpartition(":")
    return ListenAddress(host, int(port))


def router(router_id: str, addr: str) -> Listed:
    return Listed(router_id, PEER, at(addr))


def ident(router_id: str) -> str:
    return identity(PEER, router_id, at("0.0.0.0:1"))


def addrs(book: RouterBook) -> set[str]:
    return {str(entry.addr) for entry in book.entries}


def test_a_listed_router_without_a_session_gets_one_and_only_once() -> None:
    book = RouterBook([at("router-0.svc:50051")])
    (first,) = book.entries
    assert book.reached(first.id, ident("r0")) == (Verdict.GO, [])
    listing = [router("r0", "10.0.0.1:50051"), router("r1", "10.0.0.2:50051")]
    opened = book.listed(listing, now=0.0)
    # r0 is the configured entry's own router under its pod IP: no second session.
    assert [str(entry.addr) for entry in opened] == ["10.0.0.2:50051"]
    assert not opened[0].configured
    assert book.listed(listing, now=1.0) == []  # the next heartbeat's list opens nothing
    assert addrs(book) == {"router-0.svc:50051", "10.0.0.2:50051"}


def test_a_list_naming_an_address_already_dialled_opens_nothing() -> None:
    book = RouterBook([at("10.0.0.1:50051")])  # not yet answered: its router is unknown
    assert book.listed([router("r0", "10.0.0.1:50051")], now=0.0) == []


def test_a_short_or_empty_list_changes_nothing() -> None:
    book = RouterBook([at("router-0.svc:50051")])
    book.listed([router("r1", "10.0.0.2:50051"), router("r2", "10.0.0.3:50051")], now=0.0)
    before = addrs(book)
    assert book.listed([], now=10.0) == []
    assert book.listed([router("r1", "10.0.0.2:50051")], now=20.0) == []
    assert book.sweep(now=60.0) == []
    assert addrs(book) == before


def test_a_discovered_router_closes_after_two_minutes_missing_with_its_session_down() -> None:
    assert discovery.FORGET_AFTER == 120.0
    book = RouterBook([at("router-0.svc:50051")])
    (r1,) = book.listed([router("r1", "10.0.0.2:50051")], now=0.0)
    (r2,) = book.listed([router("r2", "10.0.0.3:50051")], now=0.0)
    assert book.reached(r1.id, ident("r1"))[0] is Verdict.GO  # r1's session is up
    # r2 keeps being listed until 50 s; r1 is listed no more.
    book.listed([router("r2", "10.0.0.3:50051")], now=50.0)
    assert book.sweep(now=119.9) == []
    # Two minutes: r1 is missing but its session is up, so it stays.
    assert book.sweep(now=120.0) == []
    book.went_down(r1.id)
    assert book.sweep(now=121.0) == [r1]
    assert book.get(r1.id) is None
    assert book.sweep(now=169.9) == []
    assert book.sweep(now=170.0) == [r2]  # two minutes after its last listing
    assert addrs(book) == {"router-0.svc:50051"}


def test_the_two_minutes_are_a_module_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "FORGET_AFTER", 1.0)
    book = RouterBook([])
    (entry,) = book.listed([router("r1", "10.0.0.2:50051")], now=0.0)
    assert book.sweep(now=1.0) == [entry]


def test_configured_routers_are_never_closed() -> None:
    book = RouterBook([at("router-0.svc:50051"), at("router-1.svc:50051")])
    assert book.sweep(now=1e9) == []
    assert len(book.entries) == 2 and all(entry.configured for entry in book.entries)


def test_a_configured_entry_reaching_a_discovered_router_closes_its_session_at_once() -> None:
    book = RouterBook([at("router-1.svc:50051")])  # down at first
    (found,) = book.listed([router("r1", "10.0.0.2:50051")], now=0.0)
    assert book.reached(found.id, ident("r1")) == (Verdict.GO, [])
    configured = next(entry for entry in book.entries if entry.configured)
    verdict, closing = book.reached(configured.id, ident("r1"))
    assert verdict is Verdict.GO and closing == [found]
    assert book.get(found.id) is None
    # Lists keep naming r1 at its pod IP: the configured entry reaches it, nothing opens.
    assert book.listed([router("r1", "10.0.0.2:50051")], now=5.0) == []


def test_a_discovered_duplicate_of_a_configured_router_closes_itself() -> None:
    book = RouterBook([at("router-1.svc:50051")])
    (found,) = book.listed([router("r1", "10.0.0.2:50051")], now=0.0)
    configured = next(entry for entry in book.entries if entry.configured)
    assert book.reached(configured.id, ident("r1")) == (Verdict.GO, [found])
    # Its session had authenticated meanwhile (it was dialling already): it ends.
    assert book.reached(found.id, ident("r1")) == (Verdict.CLOSE, [])
    assert [entry.id for entry in book.entries] == [configured.id]


def test_two_discovered_entries_of_one_router_keep_one_session() -> None:
    book = RouterBook([])
    (a,) = book.listed([router("r1", "10.0.0.2:50051")], now=0.0)
    # An entry for an address whose router turned out to be r1 too.
    (b,) = book.listed([router("r9", "10.0.0.9:50051")], now=0.0)
    assert book.reached(a.id, ident("r1")) == (Verdict.GO, [])
    assert book.reached(b.id, ident("r1")) == (Verdict.CLOSE, [])
    assert book.entries == [a]


def test_two_configured_names_of_one_router_stand_by_instead_of_fighting() -> None:
    book = RouterBook([at("router-a:50051"), at("router-b:50051")])
    first, second = book.entries
    assert book.reached(first.id, ident("r1")) == (Verdict.GO, [])
    # The router would replace one connection with the other: the second waits.
    assert book.reached(second.id, ident("r1")) == (Verdict.STANDBY, [])
    book.went_down(first.id)
    assert book.reached(second.id, ident("r1")) == (Verdict.GO, [])
    assert book.reached(first.id, ident("r1")) == (Verdict.STANDBY, [])
    assert len(book.entries) == 2  # neither is ever closed


def test_a_router_listed_at_a_new_address_is_dialled_there_once_its_session_is_down() -> None:
    book = RouterBook([])
    (entry,) = book.listed([router("r1", "10.0.0.2:50051")], now=0.0)
    assert book.reached(entry.id, ident("r1"))[0] is Verdict.GO
    # Restarted under a new pod IP: the old session is still up, nothing opens yet.
    assert book.listed([router("r1", "10.0.0.7:50051")], now=1.0) == []
    assert str(entry.addr) == "10.0.0.2:50051"
    book.went_down(entry.id)
    assert str(entry.addr) == "10.0.0.7:50051"
    # Listed again while down: it follows the list at once.
    book.listed([router("r1", "10.0.0.8:50051")], now=2.0)
    assert str(entry.addr) == "10.0.0.8:50051"
    assert len(book.entries) == 1


def test_a_configured_entry_keeps_its_address() -> None:
    book = RouterBook([at("router-0.svc:50051")])
    (entry,) = book.entries
    book.reached(entry.id, ident("r0"))
    book.went_down(entry.id)
    book.listed([router("r0", "10.0.0.1:50051")], now=0.0)
    assert str(entry.addr) == "router-0.svc:50051"


def test_routers_that_send_no_router_id_are_told_apart_by_address() -> None:
    book = RouterBook([at("10.0.0.1:50051"), at("10.0.0.2:50051")])
    first, second = book.entries
    assert book.reached(first.id, identity(PEER, "", first.addr))[0] is Verdict.GO
    assert book.reached(second.id, identity(PEER, "", second.addr))[0] is Verdict.GO
    assert book.holding() == 2


def test_holding_counts_the_sessions_that_are_up() -> None:
    book = RouterBook([at("a:1"), at("b:1")])
    first, second = book.entries
    book.reached(first.id, ident("a"))
    assert book.holding() == 1
    book.reached(second.id, ident("b"))
    assert book.holding() == 2
    book.went_down(first.id)
    assert book.holding() == 1


def test_unusable_list_items_are_left_out() -> None:
    raw = [
        {"router_id": "r1", "peer_id": PEER, "addr": "10.0.0.2:50051"},
        {"router_id": "r2", "peer_id": PEER, "addr": ""},
        {"router_id": "r3", "peer_id": PEER, "addr": "no-port"},
        {"router_id": "r4", "peer_id": PEER, "addr": "10.0.0.4:0"},
        {"router_id": "r5", "peer_id": PEER},
        "10.0.0.6:50051",
        {"router_id": 7, "peer_id": PEER, "addr": "10.0.0.7:50051"},
        {"router_id": "r8", "peer_id": PEER, "addr": "[::1]:50051", "zone": "extra"},
    ]
    assert parse_routers(raw) == [router("r1", "10.0.0.2:50051"), router("r8", "::1:50051")]
    assert parse_routers(None) == [] and parse_routers({"addr": "a:1"}) == []


def test_the_routers_up_are_those_whose_session_holds() -> None:
    book = RouterBook([at("router-0.svc:50051"), at("router-1.svc:50051")])
    first, second = book.entries
    assert book.routers_up() == []
    book.reached(first.id, ident("r0"))
    book.reached(second.id, ident("r1"))
    assert book.routers_up() == ["r0", "r1"]
    book.went_down(second.id)
    assert book.routers_up() == ["r0"]  # what the heartbeats tell the routers


def test_the_holder_of_a_router_is_the_entry_whose_session_has_it() -> None:
    book = RouterBook([at("a:1"), at("b:1")])
    first, second = book.entries
    assert book.reached(first.id, ident("r")) == (Verdict.GO, [])
    assert book.reached(second.id, ident("r")) == (Verdict.STANDBY, [])
    assert book.holder(second.id) is first
    assert book.holder(first.id) is None
    book.went_down(first.id)
    assert book.holder(second.id) is None
