"""Embedded persistent storage (SQLite, WAL) behind small interfaces; I/O off the event loop."""
