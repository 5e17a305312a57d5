"""The serverless per-key occupancy shares (B4) of a router of a site: kept in memory, each
budget and count divided by the site's members (they are not pooled like occupancy)."""

from __future__ import annotations

import math
from collections.abc import Callable

from hivenet_router.clock import Clock
from hivenet_router.state.local import LocalLease, LocalPool


class SharePool(LocalPool):
    def __init__(self, clock: Clock, share: Callable[[], int]) -> None:
        super().__init__(clock, alone_fits=False)
        self._share = share

    async def reserve(
        self, key: str, amount: int, budget: int, wait: float, most: int = 0
    ) -> LocalLease | None:
        share = max(1, self._share())
        divided = budget // share if budget else 0
        if budget and not divided:
            return None  # a share below one token: nothing fits (0 would mean no limit)
        most = math.ceil(most / share) if most else 0
        return await super().reserve(key, amount, divided, wait, most)
