"""Weights-only export: one state entry's tensors, nothing else, as safetensors.

Serving never needs optimizer moments, RNG states or data positions, and should not
mount the training store. The export checks one generation as restore does
(signature, run, abandonment, manifest MAC), reads the tensors of one entry
(default ``model``), every byte checked against its chunk digest (and decrypted),
optionally casts floating-point tensors (never integer or bool buffers), and writes
a stock safetensors file atomically. With a signing key it also writes a signed
export manifest (digest of the output, source run, step and generation) that
``verify_export`` checks. Signing an export vouches for its source, so a signing key
needs trusted keys: the source generation's own signature is verified first, and an
unsigned or foreign generation planted in the store is never turned into a signed
release.

:func:`consolidate_weights` writes a key prefix's tensors as a Hugging Face set. Both
stream tensor by tensor (:mod:`ckptvault.ops.consolidate`), in bounded memory.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from ckptvault.durable import atomic_path
from ckptvault.errors import FormatError, NoValidCheckpoint, StorageFullError, UsageError
from ckptvault.format.manifest import Manifest
from ckptvault.io.load import saved_world_size
from ckptvault.io.verified_ranges import VerifiedRanges
from ckptvault.ops.aliases import tensor_aliases
from ckptvault.ops.consolidate import (
    DEFAULT_MAX_SHARD,
    meter,
    plan_shards,
    prefixed_tensors,
    stream_generation,
    write_sharded,
    write_tensor_file,
)
from ckptvault.ops.export_manifest import (
    ExportResult,
    export_manifest_paths,
    write_export_manifest,
)
from ckptvault.progress import Progress
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.state.codec_names import tensor_key
from ckptvault.state.ranks import tree_for_rank
from ckptvault.storage import S3Options, StoreLocation, open_store
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import check_trusted
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import MANIFEST_INVALID, GenerationRejected, Problem
from ckptvault.trust.signing import (
    PrivateKeyLike,
    PublicKeyLike,
)

# Generations whose manifests export reads to learn the run id when none is given.
MAX_RUN_PROBES = 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ResultT = TypeVar("ResultT")

SIGNING_NEEDS_TRUST = (
    "signing an export vouches for its source: pass trusted_keys= so the "
    "source generation's signature is verified first"
)


def export_weights(
    store_dir: StoreLocation,
    step: int | None,
    out: str | os.PathLike[str],
    *,
    key: str = "model",
    dtype: str | None = None,
    run_id: str | None = None,
    signing_key: PrivateKeyLike | None = None,
    trusted_keys: Iterable[PublicKeyLike] | None = None,
    keystore: KeyStore | None = None,
    audit_log: str | os.PathLike[str] | None = None,
    ledger: str | os.PathLike[str] | None = None,
    s3: S3Options | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Export entry ``key`` of the newest verified generation of ``step`` to ``out``
    (``s3``: options of an ``s3://`` store), one tensor in memory at a time. With
    ``step=None``, the newest step whose generation verifies (steps are tried newest
    first, as :func:`consolidate_weights` does).

    ``run_id`` defaults to the one run the store holds (ambiguity is an error, so
    another run's generation planted in the store is never exported by accident);
    generations the ledger records as abandoned are never exported. ``signing_key``
    requires ``trusted_keys`` (UsageError otherwise): a signed export vouches for a
    source whose signature was verified. The export is recorded in the audit log
    (default beside the ledger) when any trust option is given. ``progress(done,
    total)`` follows the tensor bytes written. On any failure ``out`` is left as it
    was.
    """
    if signing_key is not None and trusted_keys is None:
        raise UsageError(SIGNING_NEEDS_TRUST)
    target = _cast_to(dtype)
    # Loads the signing key: a bad one fails before anything is written.
    trust, store = _open(store_dir, s3, signing_key, trusted_keys, keystore, ledger, audit_log)
    out_path = Path(os.path.abspath(os.fspath(out)))
    write = functools.partial(_write_entry, out_path, key, target, progress)
    _manifest, result = _newest_that_verifies(store, run_id, step, trust, write)
    if trust.signer is not None:
        signed = write_export_manifest(trust.signer, result, key, dtype)
        result = replace(result, manifest_path=signed)
    _record(trust, result, key)
    return result


def _write_entry(
    out_path: Path,
    key: str,
    target: torch.dtype | None,
    progress: Progress | None,
    manifest: Manifest,
    tree: Any,
    source: VerifiedRanges,
) -> ExportResult:
    """Write entry ``key`` of a checked generation to ``out_path``, atomically."""
    prefix, view = _entry_view(source.ref, manifest, tree, key)
    where = f"generation {manifest.generation_id}"
    aliases = tensor_aliases(view, key, manifest.dcp["tensors"], where)  # tied weights
    tensors = prefixed_tensors(manifest, prefix, target, aliases)
    if out_path.is_dir():  # else the rename at the end fails, naming a temporary file
        raise UsageError(
            f"out={out_path} is a directory; give the file to write, e.g. "
            f"{out_path / 'model.safetensors'}"
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _ensure_room(out_path, sum(t.nbytes for t in tensors), len(aliases))
    metadata = _file_metadata(manifest, ckptvault_entry=key)
    with atomic_path(out_path) as temporary:
        advance = meter(progress, tensors)
        digest, size = write_tensor_file(temporary, tensors, source, metadata, advance)
    # Only now that the new file replaced the old one: never leave a manifest of another
    # file, and never drop a release's manifest for an export that did not happen.
    for stale in export_manifest_paths(out_path):
        stale.unlink(missing_ok=True)
    origin = (manifest.run_id, manifest.step, manifest.generation_id)
    return ExportResult(out_path, len(tensors), size, digest, *origin, manifest_path=None)


def _ensure_room(out_path: Path, nbytes: int, aliases: int) -> None:
    """StorageFullError before anything is written when ``out_path``'s filesystem
    cannot hold the export. Each tied name gets its tensor's bytes, so a (hostile)
    tree referring to one tensor many times claims many times its size: refused
    here, not by filling the disk."""
    usage = shutil.disk_usage(out_path.parent)
    if usage.total > 0 and nbytes > usage.free:
        tied = f", {aliases} of its names tied to other tensors" if aliases else ""
        raise StorageFullError(
            f"the export to {out_path} needs {nbytes} bytes{tied}, and its filesystem has "
            f"{usage.free} free; free space, export elsewhere, or export a narrower entry"
        )


def _open(
    store_dir: StoreLocation,
    s3: S3Options | None,
    signing_key: PrivateKeyLike | None,
    trusted_keys: Iterable[PublicKeyLike] | None,
    keystore: KeyStore | None,
    ledger: str | os.PathLike[str] | None,
    audit_log: str | os.PathLike[str] | None,
) -> tuple[TrustContext, Store]:
    """The trust context and the store, checked to hold none of the control-plane
    files. As for a manager: the ledger (abandoned generations) is read with trusted
    keys or a ledger given, and the export recorded in the audit log (beside the
    ledger by default) when any trust option is given; an export without one writes
    no ledger or audit file."""
    trust = TrustContext.configure(
        signing_key=signing_key,
        trusted_keys=trusted_keys,
        keystore=keystore,
        ledger=ledger,
        audit_log=audit_log,
    )
    store = open_store(store_dir, must_exist=True, s3=s3)
    trust.check_outside(store)
    return trust, store


def _cast_to(dtype: str | None) -> torch.dtype | None:
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"dtype={dtype!r}: give one of {', '.join(DTYPES)}")
    return DTYPES[dtype] if dtype else None


def _entry_view(
    ref: GenerationRef, manifest: Manifest, tree: Any, key: str
) -> tuple[str, dict[str, Any]]:
    """The tensor key prefix of the job's state entry ``key`` (UsageError if none),
    and the job's state tree as one rank restores it."""
    where = f"generation {manifest.generation_id}"
    try:  # as one rank restores it: the job's entries
        view, _per_rank = tree_for_rank(tree, saved_world_size(manifest), 0, 1, where)
    except FormatError as exc:
        raise GenerationRejected(ref, [Problem(MANIFEST_INVALID, str(exc))]) from exc
    if key not in view:
        raise UsageError(f"the checkpoint has no entry {key!r}; entries: {', '.join(sorted(view))}")
    return tensor_key((key,)) + "/", view


def _entry_aliases(manifest: Manifest, tree: Any, prefix: str) -> dict[str, str]:
    """Tied weights under ``prefix`` where it names one state entry (``model/``): each
    tied name -> the key its tensor is stored under, as :func:`export_weights` writes
    them (a consolidated ``lm_head.weight`` was missing, and a strict load failed)."""
    parts = [part for part in prefix.split("/") if part]
    if len(parts) != 1:
        return {}
    where = f"generation {manifest.generation_id}"
    try:
        view, _per_rank = tree_for_rank(tree, saved_world_size(manifest), 0, 1, where)
    except FormatError:
        return {}  # the stream that follows refuses such a generation with its reason
    entry = next((name for name in view if tensor_key((name,)) == parts[0]), None)
    if entry is None:
        return {}
    return tensor_aliases(view, entry, manifest.dcp["tensors"], where)


def _file_metadata(manifest: Manifest, **extra: str) -> dict[str, str]:
    """The ``__metadata__`` of an output file: where its tensors come from."""
    return {
        "format": "pt",
        "ckptvault_run_id": manifest.run_id,
        "ckptvault_step": str(manifest.step),
        "ckptvault_generation_id": manifest.generation_id,
        **extra,
    }


@dataclass(frozen=True)
class ConsolidateResult:
    files: list[Path]  # the safetensors files written
    index: Path | None  # model.safetensors.index.json of a sharded set
    tensors: int
    bytes: int  # the tensors' bytes (the index's metadata.total_size)
    largest: int  # the largest tensor's bytes: about the memory consolidation held
    source: Manifest  # of the generation consolidated


def consolidate_weights(
    store_dir: StoreLocation,
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str = "model/",
    max_shard_size: int = DEFAULT_MAX_SHARD,
    dtype: str | None = None,
    run_id: str | None = None,
    trusted_keys: Iterable[PublicKeyLike] | None = None,
    keystore: KeyStore | None = None,
    audit_log: str | os.PathLike[str] | None = None,
    ledger: str | os.PathLike[str] | None = None,
    s3: S3Options | None = None,
    progress: Progress | None = None,
) -> ConsolidateResult:
    """Write the tensors under key ``prefix`` (``model/``; empty: all) of the newest
    verified generation of ``step`` (default: the newest step held) into directory
    ``out`` as Hugging Face does (:func:`~ckptvault.ops.consolidate.write_sharded`),
    named by the rest of their key with dots (``model/layer.weight`` ->
    ``layer.weight``). The generation is chosen and checked, and its bytes verified,
    as by :func:`export_weights`; on failure nothing is left. Audited."""
    if max_shard_size < 1:
        raise UsageError(f"max_shard_size={max_shard_size} must be a positive byte count")
    target = _cast_to(dtype)
    trust, store = _open(store_dir, s3, None, trusted_keys, keystore, ledger, audit_log)
    directory = Path(os.path.abspath(os.fspath(out)))
    if store.holds_path(directory):
        raise UsageError(
            f"{directory} is inside the checkpoint store {store.location}: nothing may be "
            "written into a store but generations; give an output directory outside it"
        )

    def write(manifest: Manifest, tree: Any, source: VerifiedRanges) -> ConsolidateResult:
        tensors = prefixed_tensors(manifest, prefix, target, _entry_aliases(manifest, tree, prefix))
        directory.mkdir(parents=True, exist_ok=True)
        metadata = _file_metadata(manifest, ckptvault_prefix=prefix)
        shards = plan_shards(tensors, max_shard_size)
        files, index = write_sharded(directory, shards, source, metadata, progress)
        sizes = [t.nbytes for t in tensors]
        return ConsolidateResult(files, index, len(sizes), sum(sizes), max(sizes), manifest)

    manifest, result = _newest_that_verifies(store, run_id, step, trust, write)
    done = f"step {manifest.step} was consolidated into {directory}"
    fields = {"run_id": manifest.run_id, "generation_id": manifest.generation_id}
    trust.record(done, "consolidate", step=manifest.step, out=str(directory), **fields)
    return result


def _newest_that_verifies(
    store: Store,
    run_id: str | None,
    step: int | None,
    trust: TrustContext,
    write: Callable[[Manifest, Any, VerifiedRanges], ResultT],
) -> tuple[Manifest, ResultT]:
    """``stream_generation`` of ``step``, or without one of the newest step whose
    generation verifies: steps are tried newest first, so a planted directory with a
    higher step name cannot stop a consolidation the store's genuine steps allow."""
    if step is None:
        selection = CandidateSelector(store, run_id, trust).select(None, floor_applies=False)
        steps = sorted({ref.step for ref in selection.candidates}, reverse=True)
        if not steps:
            raise NoValidCheckpoint(f"store {store.location} holds no generation to export")
    else:
        steps = [step]
    refused: NoValidCheckpoint | None = None
    for candidate in steps:
        try:
            owner = run_id if run_id is not None else _only_run(store, candidate, trust)
            return stream_generation(store, owner, candidate, trust, write)
        except NoValidCheckpoint as exc:
            refused = refused or exc
    assert refused is not None
    raise refused


def _record(trust: TrustContext, result: ExportResult, key: str) -> None:
    trust.record(
        f"step {result.step} was exported to {result.path}",
        "export",
        run_id=result.run_id,
        step=result.step,
        generation_id=result.generation_id,
        entry=key,
        out=str(result.path),
        blake3=result.blake3,
        signed=result.manifest_path is not None,
    )


def _only_run(store: Store, step: int, trust: TrustContext) -> str:
    """The run id of the generations of ``step``, when they agree (without
    ``--run-id``). Bounded: only that step's generations, newest first, at most
    :data:`MAX_RUN_PROBES` of them, each through the restore checks (with trusted
    keys the signature is checked before the manifest is parsed, so a planted
    unsigned manifest costs no parsing; with a key store, an encrypted run's, a
    plaintext one planted beside it names no run). Disagreement is an error."""
    candidates = CandidateSelector(store, None, trust).select(step, floor_applies=False)
    runs: set[str] = set()
    rejected: list[GenerationRejected] = []
    policy = trust.policy(None, None)
    probed = candidates.candidates[:MAX_RUN_PROBES]
    for ref in probed:
        try:
            runs.add(check_trusted(store, ref, policy).manifest.run_id)
        except GenerationRejected as exc:
            rejected.append(exc)
    if not runs:
        raise NoValidCheckpoint(
            f"none of the newest {len(probed)} generation(s) of step {step} in "
            f"{store.location} verifies: "
            + "; ".join(f"step {r.ref.step} ({r.ref.generation_id}): {r.reason}" for r in rejected)
            + ". Pass --run-id to look further",
            rejected=[(r.ref.generation_id, r.ref.step, r.reason) for r in rejected],
        )
    if len(runs) != 1:
        found = ", ".join(run[:80] for run in sorted(runs)[:5])
        raise UsageError(
            f"store {store.location} holds generations of step {step} of runs: {found}; "
            "pass --run-id"
        )
    return runs.pop()
