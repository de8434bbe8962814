"""What happened to a store, told to whoever listens.

The manager's parts emit an event after each thing that happened: a generation was
published, restored, refused, marked for deletion, unmarked, deleted or copied to
another tier (replicated). Subscribers turn events into their own records: the
rollback ledger raises its floor, the audit log appends an entry, retention plans
and applies itself after a publish (a replica tier's after a copy); the catalog,
metrics and replication subscribe the same way. A new feature is a new subscriber,
not a new branch in the manager. Saves that fail are told too (``SaveFailed``).

Timings ride on the events: ``Published`` and ``Restored`` carry the wall seconds of
each stage (``stages``: ``stage``, ``write``, ``fsync``, ``publish`` for a save;
``discovery``, ``verification``, ``read``, ``apply`` for a restore), measured with
``time.perf_counter`` around each phase; a stage a path does not have is absent.

Subscribers run in the order they subscribed. An exception from one stops the rest
and propagates to whoever emitted the event: the event has *already happened*, so
a subscriber's error message should say so (``event.summary``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Published:
    """A generation became visible in the store."""

    run_id: str
    store: str
    step: int
    generation_id: str
    location: str
    bytes: int
    seconds: float  # writing through publishing (the writer's own time)
    signer: str | None = None
    kek_id: str | None = None
    # How long save() blocked the caller: the whole save when synchronous; capture,
    # backpressure and the staging copy when asynchronous.
    stall_seconds: float = 0.0
    # From save() being called to the publish, queueing behind earlier saves included;
    # every stage below fits in it.
    total_seconds: float = 0.0
    stages: Mapping[str, float] = field(default_factory=dict)
    metrics: Mapping[str, int | float] | None = None  # as given to save(metrics=...)
    contract: Mapping[str, Any] | None = None  # the manifest's contract section

    @property
    def summary(self) -> str:
        return f"generation {self.generation_id} (step {self.step}) was published"


@dataclass(frozen=True)
class SaveFailed:
    """A save raised after it was accepted (while writing or publishing): nothing of
    it was published. Errors ``save()`` raises before any I/O (an unsupported value in
    the state, a bad step) are the caller's to fix and are not events."""

    run_id: str
    store: str
    step: int
    error: str  # the exception's class name
    reason: str  # its first line
    stall_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def summary(self) -> str:
        return f"the save of step {self.step} to {self.store} failed ({self.error})"


@dataclass(frozen=True)
class RollbackApplied:
    """``restore(allow_rollback_to=...)`` went below the floor on purpose."""

    previous_floor: int | None
    abandoned: Sequence[tuple[str, int]]  # (generation id, step) of every newer generation
    # A generation id made at the rollback: every generation above the new floor whose
    # id sorts before it is abandoned, listed above or not (hidden ones come back too).
    cutoff_generation_id: str
    # The step the run went back from: the highest of the previous floor and the
    # newest generation above the restored step that verified (None: neither).
    from_step: int | None = None


@dataclass(frozen=True)
class Restored:
    """A verified generation was applied to the caller's state."""

    run_id: str
    store: str
    step: int
    generation_id: str
    skipped: Sequence[tuple[str, int, str]] = ()  # (generation id, step, reason), newer ones
    rollback: RollbackApplied | None = None
    seconds: float = 0.0  # from restore() being called to the state applied
    stages: Mapping[str, float] = field(default_factory=dict)

    @property
    def summary(self) -> str:
        return f"generation {self.generation_id} (step {self.step}) was restored"


@dataclass(frozen=True)
class Refused:
    """A restore raised: nothing was applied."""

    run_id: str
    store: str
    error: str  # the exception's class name
    reason: str  # its first line
    rejected: Sequence[tuple[str, int, str]] = field(default_factory=tuple)
    seconds: float = 0.0  # from restore() being called to the refusal
    stages: Mapping[str, float] = field(default_factory=dict)

    @property
    def summary(self) -> str:
        return f"a restore from {self.store} was refused ({self.error})"


@dataclass(frozen=True)
class Marked:
    """Retention marked a generation for deletion: hidden from restore and ``ls``, its
    bytes kept until the delete delay has passed (``ckptvault gc --undelete`` undoes it)."""

    run_id: str | None
    store: str
    step: int
    generation_id: str
    reason: str
    marked_at: str

    @property
    def summary(self) -> str:
        return f"generation {self.generation_id} (step {self.step}) was marked for deletion"


@dataclass(frozen=True)
class Unmarked:
    """A deletion mark was removed (undeleted, or kept again by the rules)."""

    run_id: str | None
    store: str
    step: int
    generation_id: str
    reason: str

    @property
    def summary(self) -> str:
        return f"generation {self.generation_id} (step {self.step}) was unmarked"


@dataclass(frozen=True)
class Deleted:
    """A marked generation's bytes were deleted from every store (tier) its retention
    covers (``store`` is the first of them; per-tier retention deletes from one)."""

    run_id: str | None
    store: str
    step: int
    generation_id: str
    reason: str
    marked_at: str | None = None

    @property
    def summary(self) -> str:
        return f"generation {self.generation_id} (step {self.step}) was deleted"


@dataclass(frozen=True)
class Replicated:
    """A published generation was copied, verified, into another tier (``target``)."""

    run_id: str | None
    store: str  # the tier it was copied from
    target: str  # the tier it was copied to
    step: int
    generation_id: str
    location: str  # the copy's location in the target

    @property
    def summary(self) -> str:
        return f"generation {self.generation_id} (step {self.step}) was copied to {self.target}"


@dataclass(frozen=True)
class MemorySkipped:
    """A save's memory-tier copy was skipped: the tier had no room (``reason``)."""

    run_id: str
    store: str  # the memory tier
    step: int
    reason: str

    @property
    def summary(self) -> str:
        return f"step {self.step} was not kept in memory: {self.reason}"


@dataclass(frozen=True)
class ReplicasDisagree:
    """Replicated tensors of a multi-rank save held different bytes on some ranks
    (``ckptvault.distributed.replicas``); the generation holds rank 0's copy."""

    run_id: str
    store: str
    step: int
    generation_id: str
    slots: Sequence[dict[str, object]]  # {"slot": key, "groups": [[ranks], ...]}

    @property
    def summary(self) -> str:
        return (
            f"replicas of {len(self.slots)} tensor slot(s) differed between ranks in "
            f"generation {self.generation_id} (step {self.step})"
        )


@dataclass(frozen=True)
class Validated:
    """A generation was loaded into freshly built objects and checked (``ok``), or
    could not be (``error``, ``reason``): ``mgr.validate`` / ``ckptvault validate``."""

    run_id: str
    store: str
    step: int
    generation_id: str | None  # None when nothing could be loaded
    ok: bool
    seconds: float
    error: str | None = None  # the exception's class name
    reason: str | None = None  # its first line

    @property
    def summary(self) -> str:
        outcome = "validated" if self.ok else f"failed validation ({self.error})"
        return f"step {self.step} of {self.store} {outcome}"


Event = (
    Published
    | SaveFailed
    | Validated
    | Restored
    | Refused
    | Marked
    | Unmarked
    | Deleted
    | Replicated
    | ReplicasDisagree
    | MemorySkipped
)
Subscriber = Callable[[Event], None]


class EventBus:
    """Delivers each event to every subscriber, in subscription order."""

    def __init__(self, subscribers: Sequence[Subscriber] = ()) -> None:
        self._subscribers: list[Subscriber] = list(subscribers)

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def emit(self, event: Event) -> None:
        for subscriber in self._subscribers:
            subscriber(event)
