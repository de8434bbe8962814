"""Writing a format-3 generation's indexes, before its root manifest.

A writer that holds every chunk's metadata and every file's digests once the tensors
are written (one process; a DCP storage writer's coordinator) writes one index per
rank that wrote a file (:mod:`ckptvault.format.index`), in parallel, each fsync'd
into the staging area like any file, and records each index's size and digest in
the manifest: the root then covers them. What depends only on the layout (the root's
tensor table and each index's chunk list, encoded: :mod:`ckptvault.format.index_plan`)
is kept while the layout stays the same. In a collective save each rank writes its
own index instead (:mod:`ckptvault.distributed.rank_index`).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

from blake3 import blake3

from ckptvault.errors import FormatError
from ckptvault.format.index import (
    IndexRecord,
    encode_index,
    encode_tensor_chunks,
    files_by_holder,
)
from ckptvault.format.index_plan import IndexPlan, plan_indexes
from ckptvault.format.layout import index_file_name
from ckptvault.format.manifest import Manifest
from ckptvault.storage.base import StagingArea, write_new_file

PARALLEL_WRITES = 8


class IndexWriter:
    """Writes the indexes of one writer's generations; keeps the last layout's plan."""

    def __init__(self) -> None:
        self._plan: IndexPlan | None = None

    def write(
        self, staging: StagingArea, manifest: Manifest, planned: IndexPlan | None = None
    ) -> Manifest:
        """Write ``manifest``'s indexes into ``staging``; the manifest recording them
        (formats 1-2: ``manifest`` as it is). ``planned``: the writer's own plan of
        this layout (a one-process layout's), used rather than one made from
        ``manifest.dcp``."""
        if not manifest.indexed:
            return manifest
        names = sorted(manifest.files)
        holders = _holders(names)
        plan: IndexPlan | None = self._plan
        if planned is not None:
            plan = _covering(planned, holders)
        elif plan is None or plan.dcp is not manifest.dcp or plan.holders != holders:
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


def _covering(plan: IndexPlan, holders: tuple[int, ...]) -> IndexPlan:
    """``plan`` (a layout's, of its tensor files) for the indexes of ``holders``: a
    rank that wrote only a file without tensors (an encrypted state file) has an
    index listing no chunk."""
    if not set(plan.holders) <= set(holders):
        raise FormatError(
            f"the layout's index plan covers ranks {plan.holders}, the files {holders}: a "
            "writer's bug; nothing was published"
        )
    if plan.holders == holders:
        return plan
    empty = encode_tensor_chunks({})
    members = {holder: plan.tensors_members.get(holder, empty) for holder in holders}
    return dataclasses.replace(plan, holders=holders, tensors_members=members)


def _holders(names: list[str]) -> tuple[int, ...]:
    return tuple(sorted(files_by_holder(names)))
