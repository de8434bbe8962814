"""Observation: what a run's checkpoints cost and how healthy they are, recorded and reported.

``catalog`` (the SQLite record of generations, timings and failures; ``catalog_schema``,
``catalog_db``, ``catalog_attempts``; ``catalog_recorder`` is its subscriber),
``prometheus`` (the manager's metrics, a subscriber), ``health`` (what ``ckptvault
status`` reports and warns about), ``usage`` (storage use and replication lag from a
store's listing), ``heartbeat`` (per-rank progress files a hang watchdog reads),
``stragglers`` (per-rank step times, gathered on rank 0) and ``progress_reporter``
(what a heartbeat does).
"""
