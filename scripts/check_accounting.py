"""`make check-accounting`: the accounting checker's long run (tests/accounting/).

Starts a site on loopback (Valkey with Sentinel, PostgreSQL, three routers, agents and
simulators), sends `--requests` seeded requests from twenty tenants while a router, the
Valkey primary, PostgreSQL, an agent and (from 1,000 requests) a second router are killed,
then proves from the simulators' usage logs, the ledger, the audit records and
/admin/usage that every served token was billed once and no limit passed its documented
bound. Prints the table and writes it, with the faults, notes and findings, to `--out`.
Exits 1 when anything was found.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.accounting.check import check  # noqa: E402 (needs the repo root)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "check-accounting.md")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder and logs")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-accounting-"))
    try:
        report = check(tmp, args.seed, args.requests, args.workers)
    finally:
        if args.keep:
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    text = report.text()
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"# Accounting check: {args.requests} requests, seed {args.seed}\n\n{text}")
    print(f"written to {args.out}")
    return 1 if report.verdict.findings else 0


if __name__ == "__main__":
    sys.exit(main())
