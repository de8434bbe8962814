"""DONE records: a finished job's own statement of what it produced.

A job that finishes writes one DONE record (:func:`write_done_record`) naming its run,
final step, final generation and that generation's manifest digest, the digest of the
config it trained with and the number of tokens it consumed. ``ckptvault supervise``
checks it when the job exits 0 (:func:`check_done_record`): a record that binds the
config, the token count and the final checkpoint, not an empty marker file that could
be left over from yesterday.

The record is one canonical JSON object, written atomically and durably. Digests are
lowercase hex BLAKE3: ``config_digest`` of the config file's exact bytes
(:func:`file_digest`), ``manifest_digest`` of the generation's ``manifest.json`` bytes
(:func:`manifest_digest`). Under ``supervise`` the record also carries the supervise
run's id (``CKPTVAULT_SUPERVISE_ID``), so a record from another run is told apart.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from blake3 import blake3

from ckptvault.durable import write_atomically
from ckptvault.errors import CheckpointError, FormatError, UsageError
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.format.layout import MANIFEST_NAME
from ckptvault.format.manifest import MAX_MANIFEST_BYTES
from ckptvault.io.plain_file import read_plain_file
from ckptvault.storage.base import Store

DONE_FILE_ENV = "CKPTVAULT_DONE_FILE"  # where the job writes its record (set by supervise)
SUPERVISE_ID_ENV = "CKPTVAULT_SUPERVISE_ID"  # the supervise run the record belongs to
RECORD_KIND = "ckptvault.done"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024  # a record is a few hundred bytes; refuse anything huge
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class DoneRecord:
    """What a finished job says it produced (see the module docstring for the fields)."""

    run_id: str
    step: int
    generation_id: str
    manifest_digest: str
    config_digest: str
    tokens: int
    supervise_id: str | None = None
    written_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": RECORD_KIND, "version": RECORD_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> DoneRecord:
        """Parse and type-check a record; :class:`FormatError` names what is wrong."""
        if not isinstance(raw, dict) or raw.get("kind") != RECORD_KIND:
            raise FormatError(f"{where}: not a ckptvault DONE record (no kind {RECORD_KIND!r})")
        if raw.get("version") != RECORD_VERSION:
            raise FormatError(
                f"{where}: DONE record version {raw.get('version')!r} is not supported "
                f"(this ckptvault reads version {RECORD_VERSION}); upgrade ckptvault"
            )
        fields = {k: v for k, v in raw.items() if k not in ("kind", "version")}
        try:
            record = cls(**fields)
        except TypeError as exc:
            raise FormatError(f"{where}: DONE record has missing or unknown fields: {exc}") from exc
        problem = record._type_problem()
        if problem:
            raise FormatError(f"{where}: {problem}")
        return record

    def _type_problem(self) -> str | None:
        for name in ("step", "tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return f"DONE record field {name} must be a non-negative integer, not {value!r}"
        for name in ("manifest_digest", "config_digest"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _HEX_DIGEST.fullmatch(value):
                return f"DONE record field {name} must be 64 lowercase hex digits (BLAKE3)"
        for name in ("run_id", "generation_id", "written_at"):
            if not isinstance(getattr(self, name), str):
                return f"DONE record field {name} must be a string"
        if self.supervise_id is not None and not isinstance(self.supervise_id, str):
            return "DONE record field supervise_id must be a string or null"
        return None


def file_digest(path: str | os.PathLike[str]) -> str:
    """BLAKE3 (hex) of a file's exact bytes: the ``config_digest`` of a config file."""
    hasher = blake3()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


def manifest_digest(store: Store, generation_id: str) -> str:
    """BLAKE3 (hex) of the ``manifest.json`` bytes of ``generation_id`` in ``store``.

    Raises :class:`UsageError` when the store lists no such generation. Reads only the
    manifest: it does not verify the generation (``ckptvault verify`` does).
    """
    for ref in store.list_generations():
        if ref.generation_id == generation_id:
            return blake3(store.read_bytes(ref, MANIFEST_NAME, MAX_MANIFEST_BYTES)).hexdigest()
    raise UsageError(
        f"store {store.location} lists no generation {generation_id!r}; pass the id of a "
        "published generation (SaveHandle.result().generation_id)"
    )


def write_done_record(
    path: str | os.PathLike[str] | None = None,
    *,
    run_id: str,
    step: int,
    generation_id: str,
    manifest_digest: str,
    config_digest: str,
    tokens: int,
) -> Path | None:
    """Write the DONE record atomically and durably; return where, or None.

    ``path=None`` takes the path from ``CKPTVAULT_DONE_FILE`` (set by ``ckptvault
    supervise``); when that is unset too the job is not supervised and nothing is
    written (None). An existing record at the path is replaced whole. Raises
    :class:`UsageError` for a value that cannot be a record (negative step, a digest
    that is not 64 hex digits), before anything is written.
    """
    if path is None:
        path = os.environ.get(DONE_FILE_ENV) or None
        if path is None:
            return None
    record = DoneRecord(
        run_id=run_id,
        step=step,
        generation_id=generation_id,
        manifest_digest=manifest_digest,
        config_digest=config_digest,
        tokens=tokens,
        supervise_id=os.environ.get(SUPERVISE_ID_ENV) or None,
        written_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    )
    problem = record._type_problem()
    if problem:
        raise UsageError(f"cannot write the DONE record: {problem}")
    target = Path(path)
    write_atomically(target, dumps_canonical(record.to_json()))
    return target


def read_done_record(path: str | os.PathLike[str]) -> DoneRecord:
    """Read a DONE record; :class:`FormatError` when it is not a valid one,
    :class:`UnsafeEntryError` when the path is a symlink, FIFO or anything but a plain
    file, ``FileNotFoundError`` when there is none."""
    where = os.fspath(path)
    data = read_plain_file(
        where,
        MAX_RECORD_BYTES + 1,
        f"DONE record {where}",
        "the job must write the record itself (ckptvault.ops.done.write_done_record)",
    )
    raw = loads_canonical(data, f"DONE record {where}", max_bytes=MAX_RECORD_BYTES)
    return DoneRecord.from_json(raw, f"DONE record {where}")


def check_done_record(
    record: DoneRecord,
    *,
    supervise_id: str | None = None,
    config_digest: str | None = None,
    expect_tokens: int | None = None,
    store: Store | None = None,
) -> list[str]:
    """Every way ``record`` differs from what is expected; empty when it matches.

    Each argument left None is not checked. ``store``: the named generation must be
    listed there, at the record's step, with a manifest whose digest is the record's.
    """
    problems = []
    if supervise_id is not None and record.supervise_id != supervise_id:
        problems.append(
            f"the DONE record belongs to another supervise run ({record.supervise_id!r}, "
            f"written {record.written_at or 'at an unknown time'}): it is stale, the job "
            "did not write one this time"
        )
    if config_digest is not None and record.config_digest != config_digest:
        problems.append(
            f"config digest {record.config_digest} in the DONE record is not the BLAKE3 of "
            f"--config ({config_digest}): the job trained with another config"
        )
    if expect_tokens is not None and record.tokens != expect_tokens:
        problems.append(
            f"the DONE record counts {record.tokens} tokens, expected {expect_tokens} "
            "(--expect-tokens): the run stopped early or read other data"
        )
    if store is not None:
        problems.extend(_store_problems(record, store))
    return problems


def _store_problems(record: DoneRecord, store: Store) -> list[str]:
    try:
        refs = [r for r in store.list_generations() if r.generation_id == record.generation_id]
        if not refs:
            return [
                f"the DONE record names generation {record.generation_id}, which store "
                f"{store.location} does not list"
            ]
        # A directory planted under the same id at another step must not hide the
        # generation the record names: prefer the one at the record's step.
        ref = next((r for r in refs if r.step == record.step), refs[0])
        digest = blake3(store.read_bytes(ref, MANIFEST_NAME, MAX_MANIFEST_BYTES)).hexdigest()
    except (OSError, CheckpointError) as exc:
        return [f"cannot read generation {record.generation_id} in {store.location}: {exc}"]
    problems = []
    if ref.step != record.step:
        problems.append(
            f"the DONE record says step {record.step}, generation {ref.generation_id} is "
            f"step {ref.step}"
        )
    if digest != record.manifest_digest:
        problems.append(
            f"manifest digest of generation {ref.generation_id} in {store.location} is "
            f"{digest}, the DONE record says {record.manifest_digest}: the generation was "
            "replaced or the record is wrong"
        )
    return problems


@dataclass(frozen=True)
class DoneExpectation:
    """What ``supervise`` expects of the DONE record at ``path`` when the job exits 0.

    ``required``: a missing record is a problem (otherwise the job may write none).
    The other fields are checked when not None (see :func:`check_done_record`).
    """

    path: Path
    required: bool = False
    config_digest: str | None = None
    expect_tokens: int | None = None
    store: Store | None = None

    def problems(self, supervise_id: str | None) -> list[str]:
        """Every problem of the record at ``path``, written for ``supervise_id``'s run;
        empty when it matches (or is absent and not required)."""
        if not os.path.lexists(self.path):
            if not self.required:
                return []
            return [f"the job exited 0 without writing a DONE record at {self.path}"]
        try:
            record = read_done_record(self.path)
        except (OSError, CheckpointError) as exc:  # a damaged record is a problem
            return [f"cannot read the DONE record {self.path}: {exc}"]
        return check_done_record(
            record,
            supervise_id=supervise_id,
            config_digest=self.config_digest,
            expect_tokens=self.expect_tokens,
            store=self.store,
        )
