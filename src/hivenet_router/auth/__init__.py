"""Client and administrator authentication: separate providers, separate credentials."""
