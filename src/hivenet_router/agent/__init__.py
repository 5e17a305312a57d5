"""The agent: one long-running bridge between a router and one inference backend."""
