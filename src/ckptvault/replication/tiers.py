"""Retention across tiers: one policy for every tier, or one per tier.

``CheckpointManager(..., retention=R)`` with ``replicate_to=`` applies ``R`` to both
tiers: the plan is made from the local tier, and its marks and deletions reach the
replica too (one :class:`~ckptvault.retention.keeper.RetentionKeeper` over both).
A generation not yet copied is kept and does not count toward ``R``'s rules until
its copy lands: while copies lag, the copied generations the rules would keep stay
in both tiers, so the replica always holds what a new node can restore.

``replica_retention=Q`` gives the replica tier its own policy, for example the last
two locally and the milestones remotely. Then each tier has its own keeper, and
neither touches the other's generations or marks:

- the local keeper applies ``R`` to the local tier only, after each publish; a
  generation not yet copied to the replica (queued, copying, or to be tried again)
  counts as in flight, so it is never deleted locally before its copy exists — and
  once the copy lands the local keeper plans again;
- the replica keeper applies ``Q`` to the replica only, after each copy into it (on
  the replicator's thread, which holds the replica's writer lock), with the copy
  known to verify (every byte was checked on its way); pins made in the local tier
  (``mgr.pin``) count in the replica as well.

``R`` may be None with ``Q`` given: the local tier keeps everything. Each tier's
policy also chooses what ``object_lock_days`` locks in it
(:func:`~ckptvault.retention.locks.install_lock_rule`).
"""

from __future__ import annotations

from ckptvault.errors import UsageError
from ckptvault.replication.replicator import Replicator
from ckptvault.retention.keeper import RetentionKeeper
from ckptvault.retention.locks import install_lock_rule
from ckptvault.retention.policy import Retention
from ckptvault.run_context import RunContext


def attach_retention(
    run: RunContext,
    retention: Retention | None,
    replica_retention: Retention | None,
    replicator: Replicator | None,
) -> RetentionKeeper | None:
    """Subscribe the keepers ``retention`` and ``replica_retention`` call for to
    ``run``'s events; returns the local tier's keeper (None without ``retention``).
    The replica's own keeper, if any, is ``replicator.retention``."""
    for name, policy in (("retention", retention), ("replica_retention", replica_retention)):
        if policy is not None and not isinstance(policy, Retention):
            raise UsageError(f"{name} must be a ckptvault.Retention, got {type(policy)!r}")
    if replicator is None:
        if replica_retention is not None:
            raise UsageError(
                "replica_retention= is the policy of the replica tier; it needs "
                "replicate_to=PATH_OR_URL (or drop it and give retention= alone)"
            )
        install_lock_rule(run.store, retention)
        return RetentionKeeper.attach(run, retention)
    install_lock_rule(run.store, retention)
    install_lock_rule(replicator.target, replica_retention or retention)
    if replica_retention is None:  # one policy: planned locally, applied to both tiers
        if retention is None:
            return None
        shared = RetentionKeeper(
            run,
            retention,
            [run.store, replicator.target],
            unreplicated=replicator.unreplicated,
            count_only_copied=True,
        )
        run.events.subscribe(shared)
        return shared
    replica = RetentionKeeper(run, replica_retention, [replicator.target], after_replication=True)
    replica.collector.pin_stores.append(run.store)  # a pin made locally keeps the copy too
    replicator.retention = replica
    local = None
    if retention is not None:
        local = RetentionKeeper(run, retention, [run.store], unreplicated=replicator.unreplicated)
        run.events.subscribe(local)
    run.events.subscribe(replica)
    return local
