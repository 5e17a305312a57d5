"""Per-agent history kept on the hot path: outcomes and smoothed round-trip time.

SRTT and RTTVAR follow RFC 6298 (alpha 1/8, beta 1/4) over router-observed times from
forwarding a request to its answer's head. Persistence across restarts arrives with the
embedded store; today history lives as long as the router process.
"""

from __future__ import annotations

ALPHA = 1 / 8
BETA = 1 / 4


def smooth_rtt(srtt: float | None, rttvar: float | None, sample: float) -> tuple[float, float]:
    """Fold one round-trip sample (ms) into (SRTT, RTTVAR)."""
    if srtt is None or rttvar is None:
        return sample, sample / 2
    rttvar = (1 - BETA) * rttvar + BETA * abs(srtt - sample)
    srtt = (1 - ALPHA) * srtt + ALPHA * sample
    return srtt, rttvar
