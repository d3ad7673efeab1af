"""Checkpoint recipes and fixture builders (run with the reference: needs the `test` extra)."""
