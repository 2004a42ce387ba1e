"""Passes: one transformation or analysis per module, each a pure function from one IR level to the next."""
