"""What happens to generations after they are published.

- retention: ``retention`` (the ``Retention`` policy and its rules), ``plan`` (the
  pure planner), ``apply`` (a plan applied to every tier), ``collector`` (facts,
  verification, plan, apply; shared with ``ckptvault gc``), ``keeper`` (the
  ``Published`` subscriber), ``marks`` and ``leases`` (store records), ``metrics``,
  ``locks`` (Object Lock: what publish locks, what retention must keep);
- ``replication``: copies to a second tier; ``tiers``: one retention policy for
  every tier, or one per tier;
- ``catalog``: the SQLite record of generations, save and restore timings by stage and
  failures (``catalog_schema``, ``catalog_db``; ``catalog_recorder`` is its subscriber);
- ``prometheus``: the manager's Prometheus metrics (an event subscriber);
  ``health``: what ``ckptvault status`` reports and warns about; ``usage``: storage
  use and replication lag read from a store's listing (shared by both);
- ``cadence`` and ``sizing``: the checkpoint interval and storage planner (``ckptvault
  plan``); ``measured``: a checkpoint's size, from a generation whose manifest and
  files agree (``plan --from``).
"""
