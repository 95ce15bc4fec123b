"""Draft trees: the pure tree functions (ops.py) and the device loop that drafts and verifies trees (loop.py)."""
