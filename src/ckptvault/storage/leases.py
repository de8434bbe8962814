"""Reader leases: a restore holds one on the generation it reads, so GC waits.

A lease is a store record (kind ``lease``) named ``<generation dir>.<random>`` with
``{expires_at, pid, host}``; the retention planner never deletes a generation with
an unexpired lease. It expires on its own, so a reader that dies cannot block
deletion for longer than :data:`LEASE_SECONDS`. A reader that cannot write the store
(a read-only mount) reads without one, with a warning.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

from ckptvault.errors import CheckpointError
from ckptvault.format.layout import format_timestamp
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.records import LEASE

logger = logging.getLogger("ckptvault")

LEASE_SECONDS = 6 * 3600  # longer than reading any checkpoint should take


@contextmanager
def reading_lease(
    store: Store, ref: GenerationRef, seconds: float = LEASE_SECONDS
) -> Iterator[None]:
    """Hold a lease on ``ref`` for the duration of the ``with`` block (released on
    errors too)."""
    name = f"{ref.name.dirname}.{secrets.token_hex(4)}"
    expires = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    record = {"expires_at": format_timestamp(expires), "pid": os.getpid(), "host": _host()}
    try:
        store.put_record(LEASE, name, record)
        held = True
    except (OSError, CheckpointError) as exc:
        logger.warning(
            "could not take a reader lease on %s (%s); reading it anyway, but a garbage "
            "collection running now could delete it mid-read",
            ref.location,
            exc,
        )
        held = False
    try:
        yield
    finally:
        if held:
            try:
                store.delete_record(LEASE, name)
            except (OSError, CheckpointError) as exc:
                logger.warning("could not release the reader lease %s: %s", name, exc)


def _host() -> str:
    return socket.gethostname()[:200]
