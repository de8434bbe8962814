"""Stores whose objects can outlive a deletion: object versions and Object Lock.

In a bucket with versioning every overwritten or deleted object leaves a noncurrent
version behind, and Object Lock (or a legal hold) forbids deleting a version until
its date. Those versions are copies of a generation as much as the current objects
are, so garbage collection must delete them too, or say that it could not. A store
that can hold such copies implements :class:`RetainingStore` besides
:class:`~ckptvault.storage.base.Store` (the S3 backend does; POSIX does not):

- :meth:`RetainingStore.retained_until` says whether a published generation is
  under retention now (``"locked until <date>"``); retention keeps it, whole and
  restorable, instead of deleting part of it;
- :meth:`RetainingStore.delete_generation_reporting` deletes a generation with
  every version of its objects and returns the :class:`RetainedCopy` entries it
  was not allowed to delete, instead of failing;
- :meth:`RetainingStore.set_lock_rule` tells the store which generations its
  publish puts under retention (``object_lock_days``): the manager installs a rule
  from its retention policy (milestones), and :meth:`RetainingStore.lock_generation`
  locks a generation later (when it is pinned).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from ckptvault.format.layout import format_timestamp
from ckptvault.storage.base import GenerationRef

LockRule = Callable[[int], bool]  # step -> put the generation under retention at publish


def locked_until(until: datetime) -> str:
    """The reason retention gives for a generation under Object Lock."""
    return f"locked until {format_timestamp(until)}"


@dataclass(frozen=True)
class RetainedCopy:
    """One stored copy of a deleted generation's object that the store may not delete
    yet: a version under Object Lock retention or a legal hold, or one the backend
    refused to delete (``reason`` says which)."""

    location: str  # the object, e.g. s3://bucket/prefix/data/3/<id>/r00000-000.safetensors
    version_id: str | None
    reason: str
    retain_until: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "location": self.location,
            "version_id": self.version_id,
            "reason": self.reason,
            "retain_until": format_timestamp(self.retain_until) if self.retain_until else None,
        }


@runtime_checkable
class RetainingStore(Protocol):
    """A store whose objects may be versioned or under retention (see the module)."""

    location: str

    def retained_until(self, ref: GenerationRef) -> str | None:
        """``"locked until <date>"`` (or ``"under legal hold"``) while a published
        generation may not be deleted; None when it may."""

    def delete_generation_reporting(self, ref: GenerationRef) -> list[RetainedCopy]:
        """``Store.delete_generation`` plus every version of the generation's objects;
        returns the copies that had to stay. Also finishes an earlier deletion of a
        generation the store no longer lists (its retained versions)."""

    def set_lock_rule(self, rule: LockRule | None) -> None:
        """Which generations (by step) publish puts under retention; None: all."""

    def lock_generation(self, ref: GenerationRef) -> str | None:
        """Put a published generation under retention now (a pin); returns the
        reason (``"locked until <date>"``), or None when the store locks nothing."""
