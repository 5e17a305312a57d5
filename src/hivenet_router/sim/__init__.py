"""The engine simulator: an OpenAI- and Anthropic-compatible server that behaves like vLLM."""
