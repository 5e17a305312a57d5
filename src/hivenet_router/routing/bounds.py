"""Range checks shared by the routing settings: one wording for every refused value."""

from __future__ import annotations


def number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def bound_problem(value: float, low: float, high: float, ends: tuple[bool, bool]) -> str:
    above, below = ends
    low_ok = value > low if above else value >= low
    high_ok = value < high if below else value <= high
    # A NaN fails both comparisons, so it is refused here too.
    if low_ok and high_ok:
        return ""
    if not above and not below:
        return f"must be between {number_text(low)} and {number_text(high)}"
    low_text = f"more than {number_text(low)}" if above else f"at least {number_text(low)}"
    high_text = f"less than {number_text(high)}" if below else f"at most {number_text(high)}"
    return f"must be {low_text} and {high_text}"
