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
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ckptvault.durable import atomic_path, write_atomically
from ckptvault.errors import FormatError, IntegrityError, NoValidCheckpoint, UsageError
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.format.layout import utc_now
from ckptvault.format.manifest import Manifest
from ckptvault.io.load import saved_world_size
from ckptvault.io.verified_ranges import VerifiedRanges
from ckptvault.ops.consolidate import (
    DEFAULT_MAX_SHARD,
    Progress,
    meter,
    plan_shards,
    prefixed_tensors,
    stream_generation,
    write_sharded,
    write_tensor_file,
)
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.state.codec_names import tensor_key
from ckptvault.state.ranks import tree_for_rank
from ckptvault.storage import S3Options, StoreLocation, open_store
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy, check_structure
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import MANIFEST_INVALID, GenerationRejected, Problem
from ckptvault.trust.signing import (
    EXPORT_DOMAIN,
    PrivateKeyLike,
    PublicKeyLike,
    TrustedKeys,
    sign,
    verify,
)

EXPORT_FORMAT = "ckptvault-export/1"
# Generations whose manifests export reads to learn the run id when none is given.
MAX_RUN_PROBES = 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

SIGNING_NEEDS_TRUST = (
    "signing an export vouches for its source: pass trusted_keys/--trusted-key so the "
    "source generation's signature is verified first"
)


@dataclass(frozen=True)
class ExportResult:
    path: Path
    tensors: int
    bytes: int
    blake3: str
    run_id: str
    step: int
    generation_id: str
    manifest_path: Path | None


def export_manifest_paths(out: Path) -> tuple[Path, Path]:
    """Where the export manifest and its signature live, beside the output."""
    return out.with_name(out.name + ".manifest.json"), out.with_name(out.name + ".manifest.sig")


def export_weights(
    store_dir: StoreLocation,
    step: int,
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
    (``s3``: options of an ``s3://`` store), one tensor in memory at a time.

    ``run_id`` defaults to the one run the store holds (ambiguity is an error, so
    another run's generation planted in the store is never exported by accident);
    generations the ledger records as abandoned are never exported. ``signing_key``
    requires ``trusted_keys`` (UsageError otherwise): a signed export vouches for a
    source whose signature was verified. The export is recorded in the audit log
    (default beside the ledger). ``progress(done, total)`` follows the tensor bytes
    written. On any failure ``out`` is left as it was.
    """
    if signing_key is not None and trusted_keys is None:
        raise UsageError(SIGNING_NEEDS_TRUST)
    target = _cast_to(dtype)
    trust = TrustContext.configure(  # loads the signing key: fails before writing
        signing_key=signing_key,
        trusted_keys=trusted_keys,
        keystore=keystore,
        ledger=ledger,
        audit_log=audit_log,
        always_ledger=True,
        always_audit=True,
    )
    store = open_store(store_dir, must_exist=True, s3=s3)
    trust.check_outside(store)
    out_path = Path(os.path.abspath(os.fspath(out)))
    run_id = run_id if run_id is not None else _only_run(store, step, trust)
    write = functools.partial(_write_entry, out_path, key, target, progress)
    _manifest, result = stream_generation(store, run_id, step, trust, write)
    if trust.signer is not None:
        signed = _write_export_manifest(trust.signer, result, key, dtype)
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
    tensors = prefixed_tensors(manifest, _entry_prefix(source.ref, manifest, tree, key), target)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for stale in export_manifest_paths(out_path):  # never leave a manifest of another file
        stale.unlink(missing_ok=True)
    metadata = _file_metadata(manifest, ckptvault_entry=key)
    with atomic_path(out_path) as temporary:
        advance = meter(progress, tensors)
        digest, size = write_tensor_file(temporary, tensors, source, metadata, advance)
    origin = (manifest.run_id, manifest.step, manifest.generation_id)
    return ExportResult(out_path, len(tensors), size, digest, *origin, manifest_path=None)


def _cast_to(dtype: str | None) -> torch.dtype | None:
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype] if dtype else None


def _entry_prefix(ref: GenerationRef, manifest: Manifest, tree: Any, key: str) -> str:
    """The tensor key prefix of the job's state entry ``key`` (UsageError if none)."""
    where = f"generation {manifest.generation_id}"
    try:  # as one rank restores it: the job's entries
        view, _per_rank = tree_for_rank(tree, saved_world_size(manifest), 0, 1, where)
    except FormatError as exc:
        raise GenerationRejected(ref, [Problem(MANIFEST_INVALID, str(exc))]) from exc
    if key not in view:
        raise UsageError(f"the checkpoint has no entry {key!r}; entries: {', '.join(sorted(view))}")
    return tensor_key((key,)) + "/"


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
        raise UsageError(f"max_shard_size must be a positive byte count, not {max_shard_size}")
    target = _cast_to(dtype)
    trust = TrustContext.configure(
        trusted_keys=trusted_keys,
        keystore=keystore,
        ledger=ledger,
        audit_log=audit_log,
        always_ledger=True,
        always_audit=True,
    )
    store = open_store(store_dir, must_exist=True, s3=s3)
    trust.check_outside(store)
    directory = Path(os.path.abspath(os.fspath(out)))
    if store.holds_path(directory):
        raise UsageError(f"{directory} is inside the checkpoint store {store.location}")
    step = step if step is not None else _newest_step(store, run_id, trust)
    run_id = run_id if run_id is not None else _only_run(store, step, trust)

    def write(manifest: Manifest, _tree: Any, source: VerifiedRanges) -> ConsolidateResult:
        tensors = prefixed_tensors(manifest, prefix, target)
        directory.mkdir(parents=True, exist_ok=True)
        metadata = _file_metadata(manifest, ckptvault_prefix=prefix)
        shards = plan_shards(tensors, max_shard_size)
        files, index = write_sharded(directory, shards, source, metadata, progress)
        sizes = [t.nbytes for t in tensors]
        return ConsolidateResult(files, index, len(sizes), sum(sizes), max(sizes), manifest)

    manifest, result = stream_generation(store, run_id, step, trust, write)
    done = f"step {manifest.step} was consolidated into {directory}"
    fields = {"run_id": manifest.run_id, "generation_id": manifest.generation_id}
    trust.record(done, "consolidate", step=manifest.step, out=str(directory), **fields)
    return result


def _newest_step(store: Store, run_id: str | None, trust: TrustContext) -> int:
    """The newest step the store holds (of ``run_id``, when given)."""
    candidates = CandidateSelector(store, run_id, trust).select(None, floor_applies=False)
    if not candidates.candidates:
        raise NoValidCheckpoint(f"store {store.location} holds no generation to export")
    return max(ref.step for ref in candidates.candidates)


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


def _write_export_manifest(
    signer: Ed25519PrivateKey, result: ExportResult, key: str, dtype: str | None
) -> Path:
    """Write the signed export manifest beside the output; returns its path."""
    manifest_path, signature_path = export_manifest_paths(result.path)
    document = dumps_canonical(
        {
            "format": EXPORT_FORMAT,
            "file": result.path.name,
            "size": result.bytes,
            "blake3": result.blake3,
            "entry": key,
            "dtype": dtype,
            "tensors": result.tensors,
            "source": {
                "run_id": result.run_id,
                "step": result.step,
                "generation_id": result.generation_id,
            },
            "created_at": utc_now(),
        }
    )
    write_atomically(signature_path, sign(signer, document, EXPORT_DOMAIN))
    write_atomically(manifest_path, document)
    return manifest_path


def _only_run(store: Store, step: int, trust: TrustContext) -> str:
    """The run id of the generations of ``step``, when they agree (without
    ``--run-id``). Bounded: only that step's generations, newest first, at most
    :data:`MAX_RUN_PROBES` of them, each through the restore checks (with trusted
    keys the signature is checked before the manifest is parsed, so a planted
    unsigned manifest costs no parsing). Disagreement is an error."""
    candidates = CandidateSelector(store, None, trust).select(step, floor_applies=False)
    runs: set[str] = set()
    rejected: list[GenerationRejected] = []
    policy = TrustPolicy(trusted_keys=trust.trusted)
    probed = candidates.candidates[:MAX_RUN_PROBES]
    for ref in probed:
        try:
            runs.add(check_structure(store, ref, policy).manifest.run_id)
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


@dataclass(frozen=True)
class ExportVerification:
    signer: str
    source: dict[str, Any]
    blake3: str


def verify_export(
    file: str | os.PathLike[str], trusted_keys: Iterable[PublicKeyLike]
) -> ExportVerification:
    """Check an export's signed manifest and that the file matches it.

    Raises SignatureError (untrusted or edited manifest), IntegrityError (the file
    differs from what was signed) or FormatError (no or malformed manifest)."""
    path = Path(file)
    manifest_path, signature_path = export_manifest_paths(path)
    try:
        document = manifest_path.read_bytes()
        signature = signature_path.read_bytes()
    except FileNotFoundError as exc:
        raise FormatError(
            f"{path} has no signed export manifest ({exc.filename} is missing); export it with --signing-key"
        ) from exc
    signer = verify(
        signature, document, TrustedKeys.load(trusted_keys), EXPORT_DOMAIN, str(signature_path)
    )
    raw = loads_canonical(document, str(manifest_path))
    if raw.get("format") != EXPORT_FORMAT or raw.get("file") != path.name:
        raise FormatError(f"{manifest_path} does not describe {path.name}")
    digest, size = _digest(path)
    if size != raw["size"] or digest != raw["blake3"]:
        raise IntegrityError(
            f"{path} does not match its signed export manifest (size or BLAKE3 differs)"
        )
    return ExportVerification(signer, raw["source"], digest)


def _digest(path: Path) -> tuple[str, int]:
    """BLAKE3 and size of a file."""
    hasher = blake3()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            hasher.update(chunk)
            size += len(chunk)
    return hasher.hexdigest(), size
