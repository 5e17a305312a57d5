"""The Responses store's thread: CPU per stored row with time-ordered IDs (what
`responses.request.new_id` makes) against wholly random ones (what it made before)
(docs/benchmarks.md, "Time-ordered IDs").

    python -m bench.store_ids                      # 20,000 and 150,000 rows already stored
    python -m bench.store_ids --stored 20000 --rounds 3

Runs `SqliteResponses`' own schema and insert (`_open`, `_insert`) in this thread, on a
fresh file in a temporary folder for each cell: first the rows already stored, then 200
batches of 100 rows of 2.3 KB (the size of a stored 130-token answer with its input), four
tenants in turn, whose CPU time per row is printed. The cells alternate, so that both kinds
of ID see the same machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hivenet_router.responses.request import new_id
from hivenet_router.responses.store import SqliteResponses

BATCH = 100
BATCHES = 200
ROW = os.urandom(1150).hex().encode()
TENANTS = ["tenant-a", "tenant-b", "tenant-c", "tenant-d"]


def random_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(24).hex()}"


def per_row(make_id: Callable[[str], str], stored: int) -> float:
    with tempfile.TemporaryDirectory(prefix="hivenet-store-ids-") as folder:
        store = SqliteResponses(Path(folder), ttl=86400.0, max_bytes=1 << 40)
        store._open()

        def batch() -> list[tuple[tuple[str, str], float, bytes]]:
            now = time.time()
            return [((TENANTS[n % 4], make_id("resp")), now, ROW) for n in range(BATCH)]

        for _ in range(stored // BATCH):
            store._insert(batch())
        batches = [batch() for _ in range(BATCHES)]  # the IDs are not what is measured
        start = time.process_time()
        for rows in batches:
            store._insert(rows)
        spent = time.process_time() - start
        store._disconnect()
    return spent / (BATCH * BATCHES) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stored", default="20000,150000", help="rows stored before")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    kinds: dict[str, Callable[[str], str]] = {"random": random_id, "time-ordered": new_id}
    for stored in (int(n) for n in args.stored.split(",")):
        results: dict[str, list[float]] = {kind: [] for kind in kinds}
        for round_ in range(args.rounds):
            order = list(kinds) if round_ % 2 == 0 else list(kinds)[::-1]
            for kind in order:
                results[kind].append(per_row(kinds[kind], stored))
        for kind, values in results.items():
            shown = ", ".join(f"{v:.1f}" for v in values)
            print(f"{stored:>7} stored, {kind:>12} IDs: {min(values):5.1f} us a row ({shown})")


if __name__ == "__main__":
    main()
