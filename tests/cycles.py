"""Find objects that only the cycle collector would free.

A request's objects pointing at each other survive until a full collection: under load that
is tens of MiB held and CPU spent scanning. Tests that care wrap the work in
`freed_by_refcount` and name the types that must never be left in such a cycle.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def freed_by_refcount(*type_names: str) -> Iterator[None]:
    """Fails when an object of one of `type_names` made inside the block ends up unreachable
    but still in memory (part of a reference cycle)."""
    gc.collect()
    gc.disable()
    found: set[str] = set()
    try:
        yield
    finally:
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            found = {type(o).__name__ for o in gc.garbage} & set(type_names)
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            gc.enable()
    assert not found, f"left in reference cycles: {sorted(found)}"
