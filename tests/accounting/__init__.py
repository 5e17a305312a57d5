"""The accounting checker (issue 38, item 8): a site of routers under faults, and a proof
from independent sources that every served token was billed once and no limit was passed
beyond its documented bound. `fleet` starts the processes, `traffic` drives the official
SDKs, `verify` reads the sources and judges them. Run it with `make check-accounting`, or
its short form `tests/integration/test_accounting.py`."""
