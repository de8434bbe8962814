"""The catalog as an event subscriber: ``CheckpointManager(..., catalog=...)``.

The catalog is on by default, beside the rollback ledger (the ledger's directory,
the per-user state directory unless ``ledger=`` moves it); ``catalog=PATH`` puts it
elsewhere, ``catalog=False`` turns it off. Only the coordinator (rank 0) of a job
subscribes, so one job writes each event once.

Unlike the ledger and the audit log, the catalog is not a security record: nothing
reads it to decide what to trust. So a failure to record an event never fails the
save or restore that emitted it (the generation is published either way): it is
logged as a warning that says the event already happened, names the catalog and
says what the catalog now misses; the next event tries again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ckptvault.coordinator import Coordinator
from ckptvault.errors import UsageError
from ckptvault.events import (
    Deleted,
    Event,
    EventBus,
    MemorySkipped,
    Published,
    Refused,
    Replicated,
    Restored,
    SaveFailed,
    Validated,
)
from ckptvault.observe.catalog import Catalog, default_catalog_path
from ckptvault.observe.catalog_prune import DEFAULT_KEEP_DAYS, check_keep_days, prune
from ckptvault.storage.base import Store
from ckptvault.trust.ledger import default_ledger_path

logger = logging.getLogger("ckptvault")

RECORDED = (
    Published,
    SaveFailed,
    MemorySkipped,
    Restored,
    Refused,
    Replicated,
    Deleted,
    Validated,
)
CatalogOption = str | os.PathLike[str] | bool | None


def resolve_catalog_path(
    option: CatalogOption, ledger: str | os.PathLike[str] | None
) -> Path | None:
    """Where the manager's catalog lives: None when ``option`` is False; beside the
    ledger (given or default) when it is None or True; else the path given."""
    if option is False:
        return None
    if option is None or option is True:
        return default_catalog_path(Path(ledger) if ledger is not None else default_ledger_path())
    if not isinstance(option, (str, os.PathLike)) or not os.fspath(option):
        raise UsageError(
            f"catalog={option!r}: give a file path for the catalog, or False to turn it off"
        )
    return Path(os.path.abspath(os.fspath(option)))


class CatalogRecorder:
    """Records each event the catalog keeps; logs, never raises, when it cannot.

    The file is opened per event (one short connection, like the ledger's), so a
    recorder holds nothing open between saves and needs no closing; it is called
    from the save worker and replication threads as well as the caller's."""

    def __init__(self, path: Path, keep_days: float | None = DEFAULT_KEEP_DAYS) -> None:
        self.path = path
        self.keep_days = keep_days  # prune older rows at the first write (None: never)

    def __call__(self, event: Event) -> None:
        if not isinstance(event, RECORDED):
            return
        try:
            with Catalog(self.path) as catalog:
                catalog.record(event)
                if self.keep_days is not None:
                    keep_days, self.keep_days = self.keep_days, None  # once per manager
                    prune(catalog, keep_days)
        except Exception as exc:  # a record of what happened; never worth failing for
            logger.warning(
                "%s, but recording it in the catalog %s failed: %s: %s (the catalog misses "
                "this entry; nothing else is affected)",
                event.summary,
                self.path,
                type(exc).__name__,
                exc,
            )


def subscribe_catalog(
    events: EventBus,
    store: Store,
    coordinator: Coordinator,
    option: CatalogOption,
    ledger: str | os.PathLike[str] | None,
    keep_days: float | None = DEFAULT_KEEP_DAYS,
) -> CatalogRecorder | None:
    """Subscribe the catalog the options ask for to ``events`` (on the coordinator
    only); returns it, or None when it is off or this rank does not write it.

    Raises ``UsageError`` for a catalog path inside the store: like the ledger, it is
    control-plane state, and whoever can write the store must not rewrite its record.
    """
    path = resolve_catalog_path(option, ledger)
    if path is None:
        return None
    if store.holds_path(path):
        raise UsageError(
            f"the catalog ({path}) is inside the checkpoint store {store.location}; "
            "whoever can write the store could then rewrite the record of saves and "
            "restores. Give catalog= a path outside it, or catalog=False"
        )
    if not coordinator.is_coordinator:
        return None
    recorder = CatalogRecorder(path, check_keep_days(keep_days))
    events.subscribe(recorder)
    return recorder
