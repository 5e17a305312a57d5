"""The agent connection: identity, TLS with a pinned key, frames and the stream multiplexer."""
