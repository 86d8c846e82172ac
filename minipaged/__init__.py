"""minipaged."""
