"""Retention, cadence, catalog and metrics (later issues)."""
