"""What the Lightning plugin put at each path, and what Lightning let go of: in the store.

Pruning deletes generations, so what decides it must be out of reach of whoever can
write ``ModelCheckpoint``'s directory but not the store. A pointer file there is only
a hint for loading (a planted one may name any generation); it never says which
generation a removal releases. So the plugin keeps two kinds of record in the run's
store, beside the generations they are about:

- ``lightning-pointer``: one per path the plugin put a pointer at (named by the
  BLAKE3 of the absolute path; the path, step and generation id inside). It keeps its
  generation: a generation any of them names is never pruned. Lightning removing or
  overwriting the path releases the generation *this record* names, whatever the
  file there says now.
- ``lightning-released``: one per generation Lightning let go of that is not gone
  yet (retention keeps the verified fallback, a delay, a lease), so that the next
  process still prunes it once nothing protects it.

Records are read bounded and checked field by field (a malformed one is ignored: a
pointer record that cannot be read keeps nothing and releases nothing, and a released
record that cannot be read releases nothing). Whoever can write the store could plant
a released record; they could delete the generation outright, and the pruning still
runs through retention's safety net (newest verified, a fallback, pins, the floor).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from blake3 import blake3

from ckptvault.format.layout import (
    MAX_STEP,
    GenerationName,
    is_generation_id,
    parse_generation_dirname,
    utc_now,
)
from ckptvault.storage.base import Store

logger = logging.getLogger("ckptvault")

POINTER_RECORD = "lightning-pointer"
RELEASED_RECORD = "lightning-released"
# ModelCheckpoint keeps save_top_k paths and a last one per directory; far fewer.
MAX_POINTER_RECORDS = 10_000
_MAX_PATH = 4096


def _key(path: Path) -> str:
    return blake3(os.fsencode(os.path.abspath(path))).hexdigest()


class PointerBook:
    """The plugin's records in ``store`` (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- pointers ----------------------------------------------------------------------

    def put(self, path: Path, name: GenerationName) -> None:
        """Record that the plugin put a pointer to ``name`` at ``path``."""
        where = os.path.abspath(path)
        record = {"path": where, "step": name.step, "generation_id": name.generation_id}
        self.store.put_record(POINTER_RECORD, _key(path), record)

    def at(self, path: Path) -> GenerationName | None:
        """The generation the plugin put at ``path``, or None (never, or unreadable)."""
        key = _key(path)
        found = self.store.list_records(POINTER_RECORD, key.__eq__, 1).get(key)
        return _pointer_name(found, os.path.abspath(path)) if found is not None else None

    def drop(self, path: Path) -> None:
        self.store.delete_record(POINTER_RECORD, _key(path))

    def named(self) -> set[GenerationName] | None:
        """Every generation a pointer record names; None when there are more records
        than one listing reads (then nothing may be pruned: an unread one may keep one)."""
        records = self.store.list_records(POINTER_RECORD, limit=MAX_POINTER_RECORDS + 1)
        if len(records) > MAX_POINTER_RECORDS:
            return None
        names = set()
        for key, data in records.items():
            path = data.get("path")
            if not isinstance(path, str) or key != _key(Path(path)):  # not its own path's
                continue
            name = _pointer_name(data, path)
            if name is not None:
                names.add(name)
        return names

    # -- releases ----------------------------------------------------------------------

    def release(self, name: GenerationName) -> None:
        self.store.put_record(RELEASED_RECORD, name.dirname, {"released_at": utc_now()})

    def released(self) -> set[GenerationName]:
        records = self.store.list_records(RELEASED_RECORD, limit=MAX_POINTER_RECORDS)
        names = {parse_generation_dirname(dirname) for dirname in records}
        return {name for name in names if name is not None}

    def forget(self, names: set[GenerationName]) -> None:
        """Remove the released records of ``names`` (gone from the store)."""
        for name in names:
            self.store.delete_record(RELEASED_RECORD, name.dirname)


def _pointer_name(data: dict[str, Any], path: Any) -> GenerationName | None:
    """The generation a pointer record names, when every field is what ``put``
    writes and the record is the one of its path."""
    step, generation_id = data.get("step"), data.get("generation_id")
    if not (
        set(data) == {"path", "step", "generation_id"}
        and isinstance(path, str)
        and data["path"] == path
        and len(path) <= _MAX_PATH
        and type(step) is int
        and 0 <= step <= MAX_STEP
        and isinstance(generation_id, str)
        and is_generation_id(generation_id)
    ):
        logger.warning("ignoring a malformed %s record in the store", POINTER_RECORD)
        return None
    return GenerationName(step, generation_id)
