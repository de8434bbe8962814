"""Removing staging leftovers and deleting published generations on POSIX.

A save that never published (a crash, a kill) leaves ``.staging/<generation id>/``
behind. :func:`remove_stale_staging` removes leftovers whose newest change is older
than ``older_than`` seconds (every one, when the caller holds the writer lock and
gives no age). :func:`delete_generation` takes a generation out of the listing with
one atomic rename into staging, where an interrupted delete is a leftover like any
other, and then removes its bytes. Only what lies inside the store is removed.
"""

from __future__ import annotations

import logging
import os
import time

from ckptvault.format.layout import STAGING_DIR
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.posix.files import (
    PosixRoot,
    newest_change,
    opened,
    remove_tree,
    translate_os_error,
)

logger = logging.getLogger("ckptvault")


def remove_stale_staging(store: PosixRoot, older_than: float | None) -> list[str]:
    """Remove staging leftovers older than ``older_than`` seconds (None: all of them;
    the caller holds the writer lock); the names removed."""
    if not store.root.is_dir():
        return []
    cutoff = None if older_than is None else time.time() - older_than
    removed = []
    try:
        with opened(store.open_staging_dir()) as staging_fd:
            for name in sorted(os.listdir(staging_fd)):
                if cutoff is not None and newest_change(staging_fd, name) >= cutoff:
                    continue  # still being written, or too recent to call dead
                if remove_tree(staging_fd, name):
                    removed.append(name)
                else:
                    logger.warning(
                        "could not remove the staging leftover %s; it is ignored",
                        os.path.join(store.location, STAGING_DIR, name),
                    )
    except OSError as exc:
        raise translate_os_error(exc, f"cleaning {store.location}/{STAGING_DIR}") from exc
    return removed


def delete_generation(store: PosixRoot, ref: GenerationRef) -> None:
    """One atomic rename takes the generation out of the listing (into staging,
    where an interrupted delete is a leftover like any other); then its bytes go."""
    doomed = f"{ref.generation_id}.deleted"
    try:
        with opened(store.open_root()) as root_fd, opened(store.open_staging_dir()) as staging_fd:
            try:
                os.rename(ref.name.dirname, doomed, src_dir_fd=root_fd, dst_dir_fd=staging_fd)
            except FileNotFoundError:
                return  # already gone
            os.fsync(root_fd)
            remove_tree(staging_fd, doomed)
    except OSError as exc:
        raise translate_os_error(exc, f"deleting {ref.location}") from exc
