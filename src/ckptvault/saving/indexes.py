"""Writing a format-3 generation's indexes, before its root manifest.

The coordinator has every rank's chunk metadata and file digests once the tensors
are written (DCP gathers them to it), so it writes one index per rank that wrote a
file (:mod:`ckptvault.format.index`), in parallel, each fsync'd into the staging
area like any file, and records each index's size and digest in the manifest: the
root then covers them. What depends only on the layout (the root's tensor table and
each index's chunk list, encoded) is kept while the layout stays the same.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from ckptvault.format.index import (
    IndexRecord,
    chunks_by_holder,
    encode_index,
    encode_tensor_chunks,
    files_by_holder,
)
from ckptvault.format.layout import file_holder, index_file_name
from ckptvault.format.manifest import Manifest
from ckptvault.format.tensor_table import TensorTable, build_tensor_table
from ckptvault.storage.base import StagingArea, write_new_file

PARALLEL_WRITES = 8


@dataclass(frozen=True)
class IndexPlan:
    """What a layout's indexes hold besides digests."""

    dcp: dict[str, Any]  # the dcp section it was made from (kept while it is the same object)
    holders: tuple[int, ...]
    table: TensorTable
    tensors_members: dict[int, bytes]  # holder -> the encoded ``tensors`` member of its index


def plan_indexes(dcp: dict[str, Any], file_names: list[str]) -> IndexPlan:
    holders = tuple(sorted(files_by_holder(file_names)))
    by_holder = chunks_by_holder(dcp["tensors"])
    members = {holder: encode_tensor_chunks(by_holder.get(holder, {})) for holder in holders}
    holders_by_file = {name: file_holder(name) or 0 for name in file_names}
    table = build_tensor_table(
        dcp["tensors"], lambda name: holders_by_file.get(name) or file_holder(name) or 0
    )
    return IndexPlan(dcp, holders, table, members)


class IndexWriter:
    """Writes the indexes of one writer's generations; keeps the last layout's plan."""

    def __init__(self) -> None:
        self._plan: IndexPlan | None = None

    def write(self, staging: StagingArea, manifest: Manifest) -> Manifest:
        """Write ``manifest``'s indexes into ``staging``; the manifest recording them
        (formats 1-2: ``manifest`` as it is)."""
        if not manifest.indexed:
            return manifest
        plan = self._plan
        names = sorted(manifest.files)
        if plan is None or plan.dcp is not manifest.dcp or plan.holders != _holders(names):
            plan = self._plan = plan_indexes(manifest.dcp, names)
        grouped = files_by_holder(names)

        def write_one(holder: int) -> tuple[str, IndexRecord]:
            files = {name: manifest.files[name] for name in grouped[holder]}
            data = encode_index(
                manifest.run_id,
                manifest.generation_id,
                holder,
                files,
                plan.tensors_members[holder],
            )
            name = index_file_name(holder)
            write_new_file(staging, name, data)
            return name, IndexRecord(len(data), blake3(data).hexdigest())

        if len(plan.holders) <= 1:
            records = dict(map(write_one, plan.holders))
        else:
            workers = min(PARALLEL_WRITES, len(plan.holders))
            with ThreadPoolExecutor(workers, thread_name_prefix="ckptvault-index") as pool:
                records = dict(pool.map(write_one, plan.holders))
        return dataclasses.replace(manifest, indexes=records, tensor_table=plan.table)


def _holders(names: list[str]) -> tuple[int, ...]:
    return tuple(sorted(files_by_holder(names)))
