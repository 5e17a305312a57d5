"""Stateful routing parts: circuit breakers, adaptive concurrency, prefix affinity."""
