"""Occupancy shared by the routers of a site: a wallet of credits per model (a `Pool`).

A model's budget must hold at every moment, so it is not synced after the fact like a
rate: the store keeps, per model, how many credits each router holds, and grants a router
more only from what nobody holds (sync/store.py GRANT, one atomic script). This router
admits against its wallet in memory; a request that finds the wallet short starts one grant
request for the model and waits in the pool's line like any request waiting for room (at
most the park timeout). With Sentinel every grant waits for a replica's acknowledgement;
without one in time the grant is used, but the router stays at its share of the budget
until a later round is acknowledged.

Each round (`maintain`) keeps what is in use plus a small headroom (none when another router
found its wallet empty), writes what the wallet holds (growth of streams included), and
hands a wallet idle for a minute back whole.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivenet_router.clock import Clock
from hivenet_router.state.local import LocalLease, LocalPool, _Occupancy

log = logging.getLogger("hivenet_router.sync")

IDLE_HAND_BACK = 60.0
HEADROOM = 0.1  # of a router's share of the budget
# After a grant that gave nothing, the model's waiters do not ask again for this long:
# the pool changes only when routers hand credits back (a round) or requests end.
REFUSED_PAUSE = 0.1
# How long credits gathered by partial grants are kept for the request that wanted more.
WANTING_FOR = 1.0


@dataclass(slots=True)
class Wallet:
    budget: int = 0  # the model's whole budget, as admission last computed it
    held: int = 0  # credits the store says this router holds
    acked: bool = True  # the last grant (or round) reached a replica
    short: bool = False  # a grant came back smaller than asked since the last round
    asking: asyncio.Task[None] | None = None
    quiet_until: float = 0.0  # monotonic: no new grant before (the last one gave nothing)
    # monotonic: a request wanted more than the pool could give until then; the round
    # keeps what was gathered for it instead of handing it back as unused
    wanting_until: float = 0.0


@dataclass(frozen=True, slots=True)
class Grant:
    held: int  # what this router holds after the grant
    granted: int
    acked: bool


class CreditPool(LocalPool):
    """Work in flight per model, admitted against this router's credits.

    `ask(model, wanted, budget)` runs the grant (None when the store did not answer);
    `share()` is the live-router count; `usable()` says whether credits may be used at
    all (False before the first good round, and when an agent reconnected while the store
    was unreachable)."""

    def __init__(
        self,
        clock: Clock,
        ask: Callable[[str, int, int], Awaitable[Grant | None]],
        share: Callable[[], int],
        usable: Callable[[], bool],
        can_ask: Callable[[], bool],
        starving: Callable[[str], bool] = lambda key: False,
    ) -> None:
        super().__init__(clock, alone_fits=False)
        self._ask = ask
        self._share = share
        self._usable = usable
        self._can_ask = can_ask
        self._starving = starving
        self.wallets: dict[str, Wallet] = {}
        self.grants = {"granted": 0, "partial": 0, "refused": 0, "error": 0}
        self.acks = {"acked": 0, "unacked": 0}

    async def reserve(
        self, key: str, amount: int, budget: int, wait: float, most: int = 0
    ) -> LocalLease | None:
        share = max(1, self._share())
        if budget:
            wallet = self.wallets.get(key)
            if wallet is None:
                wallet = self.wallets[key] = Wallet()
            wallet.budget = budget
            amount = min(amount, budget)  # an oversized request needs the whole budget free
            entry = self._entries.get(key)
            if entry is not None and entry.waiters:
                # A line is waiting: it goes straight to the line below, without a fit check
                # that would ask the pool; ask for the line's credits here.
                self._want(key, wallet, entry.tokens + amount * (len(entry.waiters) + 1))
        most = math.ceil(most / share) if most else 0  # the count backstop: a share of it
        return await super().reserve(key, amount, budget, wait, most)

    def _fits(self, entry: _Occupancy, amount: int, budget: int, most: int) -> bool:
        if most and entry.inflight >= most:
            return False
        if not budget:
            return True
        wallet = self.wallets[entry.key]
        need = entry.tokens + amount
        if need <= self.spendable(wallet, entry.key):
            return True
        self._want(entry.key, wallet, need)
        return False

    def spendable(self, wallet: Wallet, key: str = "") -> int:
        """What this router may admit against now: its credits; its share of the budget
        at most while they are not acknowledged, or while another router's wallet for the
        model is empty (credits this router frees above its share then wait for the round
        that hands them back, instead of going to its own next request)."""
        if not self._usable():
            return 0
        if wallet.acked and not (key and self._starving(key)):
            return wallet.held
        return min(wallet.held, wallet.budget // max(1, self._share()))

    def _headroom(self, wallet: Wallet) -> int:
        return math.ceil(HEADROOM * wallet.budget / max(1, self._share()))

    def _want(self, key: str, wallet: Wallet, need: int) -> None:
        if wallet.asking is not None or not self._can_ask() or need <= wallet.held:
            return
        if self.clock.monotonic() < wallet.quiet_until:
            return
        wanted = need - wallet.held + self._headroom(wallet)
        wallet.asking = asyncio.ensure_future(self._grant(key, wallet, wanted))

    async def _grant(self, key: str, wallet: Wallet, wanted: int) -> None:
        granted = 0
        try:
            grant = await self._ask(key, wanted, wallet.budget)
            if grant is None:
                self.grants["error"] += 1
                return
            granted = grant.granted
            if granted >= wanted:
                self.grants["granted"] += 1
            else:
                wallet.short = True
                wallet.wanting_until = self.clock.monotonic() + WANTING_FOR
                self.grants["partial" if granted else "refused"] += 1
            self.acks["acked" if grant.acked else "unacked"] += 1
            if granted:
                wallet.held, wallet.acked = grant.held, grant.acked
        finally:
            wallet.asking = None
            if granted:
                self.wake_all(key)  # room appeared: every waiter checks again
            else:
                wallet.quiet_until = self.clock.monotonic() + REFUSED_PAUSE

    # -- the sync round ----------------------------------------------------------------------

    def maintain(self, empty_elsewhere: set[str], settling: bool = False) -> dict[str, int]:
        """What each wallet should hold in the store after this round (0: hand it back).

        The wallet keeps its granted credits in use plus a headroom; the store is told the
        larger of that and what is in use, so streamed growth past the credits counts as
        held for the others, but never becomes credits this router may admit against.
        While the store settles after a loss no credit is granted, so none is handed back
        either. A wallet idle for a minute is handed back whole (`handed_back` drops it
        once the store has it)."""
        out: dict[str, int] = {}
        for key, wallet in self.wallets.items():
            used = self.held(key)
            idle = used == 0 and wallet.asking is None and self.idle_for(key) >= IDLE_HAND_BACK
            if idle and not settling:
                wallet.held = 0
                out[key] = 0
                continue
            fair = wallet.budget // max(1, self._share())
            if settling:
                pass  # nothing is granted meanwhile: keep it all
            elif key in empty_elsewhere:
                # Another router found nothing to take: keep what is in use, or the fair
                # share, whichever is more; the rest goes back to the pool.
                wallet.held = min(wallet.held, max(used, fair))
            elif self.clock.monotonic() < wallet.wanting_until:
                # Credits gathered for a request that wanted more: kept, up to the share.
                wallet.held = min(wallet.held, max(used + self._headroom(wallet), fair))
            else:
                wallet.held = min(wallet.held, used + self._headroom(wallet))
            out[key] = max(used, wallet.held)
        return out

    def handed_back(self, holdings: dict[str, int]) -> None:
        """The round that wrote `holdings` succeeded: drop the wallets it emptied (unless a
        request took credits meanwhile)."""
        for key, held in holdings.items():
            wallet = self.wallets.get(key)
            if (
                held == 0
                and wallet is not None
                and wallet.held == 0
                and wallet.asking is None
                and not self.held(key)
            ):
                del self.wallets[key]

    def empty(self) -> list[str]:
        """Models whose wallet came back short since the last round (then cleared)."""
        out = [key for key, wallet in self.wallets.items() if wallet.short]
        for key in out:
            self.wallets[key].short = False
        return out

    def drop_credits(self) -> None:
        """This router was given up: the credits it believed it held are gone."""
        for wallet in self.wallets.values():
            wallet.held = 0

    def acknowledged(self) -> None:
        """A replica acknowledged this router's writes: full wallets again."""
        for wallet in self.wallets.values():
            wallet.acked = True

    def cancel(self) -> None:
        for wallet in self.wallets.values():
            if wallet.asking is not None:
                wallet.asking.cancel()
