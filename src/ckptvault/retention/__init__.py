"""Retention and garbage collection: which generations a run keeps, and deleting the rest safely.

``policy`` (the ``Retention`` policy and its rules), ``plan`` and ``decisions`` (the
pure planner), ``collector`` (facts, verification, plan; shared with ``ckptvault
gc``), ``vouching`` (what other tiers hold), ``apply`` (a plan applied to every
tier), ``keeper`` (the ``Published`` subscriber), ``marks`` (deletion marks and pins,
store records), ``locks`` (Object Lock: what publish locks, what retention must keep).
"""
