"""The names of stages and observers the router is configured with, checked at start."""

from __future__ import annotations

import pytest

from hivenet_router.config.options import ConfigError
from hivenet_router.config.router import RouterConfig
from hivenet_router.router.wiring import check_names


@pytest.mark.parametrize(
    "stages",
    [
        ("rate", "admission", "wallet", "cache", "validator"),
        ("rate", "cache", "admission"),
        ("rate", "wallet", "cache", "validator"),  # no admission: no token limits, by choice
        ("wallet", "cache"),  # no admission: nothing counts requests, by choice
        (),
    ],
)
def test_orders_that_bill_rightly_are_taken(stages: tuple[str, ...]) -> None:
    check_names(RouterConfig(stages=stages))


@pytest.mark.parametrize(
    ("stages", "says"),
    [
        (("wallet", "cache", "wallet"), "wallet named more than once"),
        (("cache", "wallet"), "wallet must come before cache"),
        # a request refused by a limit never touches the ledger
        (("rate", "wallet", "admission", "cache"), "admission must come before wallet"),
        (("rate", "admission", "validator", "wallet"), "wallet must come before validator"),
        (("wallet", "cahce"), "unknown cahce"),
        # the rate before everything that takes a shared resource
        (("wallet", "rate", "cache"), "rate must come before wallet"),
        (("cache", "rate", "admission"), "rate must come before cache"),
        (("admission", "rate"), "rate must come before admission"),
        # a list written when admission counted requests would lose the rate
        (("wallet", "cache", "admission", "validator"), "admission needs rate before it"),
    ],
)
def test_orders_that_would_bill_wrongly_are_refused(stages: tuple[str, ...], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        check_names(RouterConfig(stages=stages))


def test_an_observer_named_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="metrics named more than once"):
        check_names(RouterConfig(observers=("metrics", "audit", "metrics")))
