"""Process options, each declared once, and the parsers for their values."""
