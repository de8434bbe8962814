"""Digests and the checks a generation must pass before any of its bytes is used."""
