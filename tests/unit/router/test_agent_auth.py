from __future__ import annotations

from hivenet_router.clock import ManualClock
from hivenet_router.router.agent_auth import FailureLimiter, Sessions


def test_sessions_expire_and_are_revoked() -> None:
    clock = ManualClock()
    sessions = Sessions(clock, 3600)
    grant = sessions.issue("peer-a")
    assert sessions.check(grant.token) is not None
    assert sessions.check("forged") is None
    clock.advance(3601)
    assert sessions.check(grant.token) is None
    again = sessions.issue("peer-a")
    sessions.revoke_peer("peer-a")
    assert sessions.check(again.token) is None
    assert not sessions.live(again)


def test_failed_authentications_are_limited_per_source() -> None:
    clock = ManualClock()
    limiter = FailureLimiter(clock, limit=3)
    for _ in range(3):
        assert not limiter.blocked("10.0.0.1")
        limiter.failed("10.0.0.1")
    assert limiter.blocked("10.0.0.1")
    assert not limiter.blocked("10.0.0.2")
    clock.advance(61)
    assert not limiter.blocked("10.0.0.1")
