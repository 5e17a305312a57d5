"""Hivenet Router: one OpenAI- and Anthropic-compatible endpoint over a fleet of engines."""
