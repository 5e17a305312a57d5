"""Lean HTTP/1.1 on asyncio with httptools: the agent's client to its engine."""
