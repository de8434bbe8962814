"""Weights-only export: one state entry's tensors, nothing else, as safetensors.

Serving never needs optimizer moments, RNG states or data positions, and should not
mount the training store. The export reads one generation through the same
verified path as restore (signature, digests, decryption), keeps the tensors of one
entry (default ``model``), optionally casts floating-point tensors (never integer
or bool buffers), and writes a stock safetensors file atomically. With a signing
key it also writes a signed export manifest (digest of the output, source run,
step and generation) that ``verify_export`` checks. Signing an export vouches for
its source, so a signing key needs trusted keys: the source generation's own
signature is verified first, and an unsigned or foreign generation planted in the
store is never turned into a signed release.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

from ckptvault.durable import atomic_path, write_atomically
from ckptvault.errors import (
    FormatError,
    IntegrityError,
    NoValidCheckpoint,
    UsageError,
)
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.format.layout import utc_now
from ckptvault.format.manifest import Manifest
from ckptvault.io.load import load_verified
from ckptvault.io.writer import default_threads
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.state.capture import StatefulPayload
from ckptvault.storage import S3Options, StoreLocation, open_store
from ckptvault.storage.base import Store
from ckptvault.trust.checks import TrustPolicy, check_structure
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import GenerationRejected
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


def _collect_tensors(value: Any, prefix: str, into: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        into[prefix] = value
    elif isinstance(value, StatefulPayload):
        _collect_tensors(value.state, prefix, into)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _collect_tensors(item, f"{prefix}.{key}" if prefix else str(key), into)


def select_weights(
    saved: Mapping[str, Any], key: str, dtype: str | None
) -> dict[str, torch.Tensor]:
    """The tensors of entry ``key``, floating point ones cast to ``dtype``."""
    if key not in saved:
        raise UsageError(
            f"the checkpoint has no entry {key!r}; entries: {', '.join(sorted(saved))}"
        )
    target = DTYPES[dtype] if dtype else None
    tensors: dict[str, torch.Tensor] = {}
    _collect_tensors(saved[key], "", tensors)
    if not tensors:
        raise UsageError(f"entry {key!r} holds no tensors")
    result: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if target is not None and tensor.is_floating_point():
            tensor = tensor.to(target)
        # Tied weights arrive as one tensor under several names: give each name its
        # own bytes, so stock safetensors (which refuses shared memory) writes them.
        if id(tensor) in seen or any(tensor.data_ptr() == t.data_ptr() for t in result.values()):
            tensor = tensor.clone()
        seen.add(id(tensor))
        result[name] = tensor.contiguous()
    return result


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
) -> ExportResult:
    """Export entry ``key`` of the newest verified generation of ``step`` to ``out``
    (``s3``: options of an ``s3://`` store).

    ``run_id`` defaults to the one run the store holds (ambiguity is an error, so
    another run's generation planted in the store is never exported by accident);
    generations the ledger records as abandoned are never exported. ``signing_key``
    requires ``trusted_keys`` (UsageError otherwise): a signed export vouches for a
    source whose signature was verified. The export is recorded in the audit log
    (default beside the ledger).
    """
    if signing_key is not None and trusted_keys is None:
        raise UsageError(SIGNING_NEEDS_TRUST)
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
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
    manifest, tensors = _load_weights(store, run_id, step, trust, key, dtype)
    out_path = Path(os.path.abspath(os.fspath(out)))
    digest, size = _write_weights(out_path, tensors, manifest, key)
    signed_path = None
    if trust.signer is not None:
        signed_path = _write_export_manifest(
            trust.signer, out_path, size, digest, key, dtype, len(tensors), manifest
        )
    result = ExportResult(
        out_path,
        len(tensors),
        size,
        digest,
        manifest.run_id,
        manifest.step,
        manifest.generation_id,
        signed_path,
    )
    _record(trust, result, key)
    return result


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


def _load_weights(
    store: Store, run_id: str | None, step: int, trust: TrustContext, key: str, dtype: str | None
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The newest generation of ``step`` that verifies (through restore's own path),
    and the tensors of its entry ``key``. Export never rewinds a run, so the floor
    does not apply; abandoned generations stay refused."""
    run_id = run_id if run_id is not None else _only_run(store, step, trust)
    selector = CandidateSelector(store, run_id, trust)
    selection = selector.select(step, floor_applies=False)  # never empty: a step is given
    _ref, loaded = selector.first_verified(
        selection,
        lambda ref, policy: load_verified(
            store,
            ref,
            policy,
            trust.keystore,
            default_threads(),
            # As restore: an encrypted run never exports a planted plaintext generation.
            require_encryption=trust.keystore is not None,
        ),
    )
    return loaded.manifest, select_weights(loaded.saved, key, dtype)


def _write_weights(
    out_path: Path, tensors: dict[str, torch.Tensor], manifest: Manifest, key: str
) -> tuple[str, int]:
    """Write the safetensors file atomically; returns its BLAKE3 digest and size."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for stale in export_manifest_paths(out_path):  # never leave a manifest of another file
        stale.unlink(missing_ok=True)
    metadata = {
        "format": "pt",
        "ckptvault_run_id": manifest.run_id,
        "ckptvault_step": str(manifest.step),
        "ckptvault_generation_id": manifest.generation_id,
        "ckptvault_entry": key,
    }
    with atomic_path(out_path) as temporary:
        save_file(tensors, str(temporary), metadata=metadata)
        return _digest(temporary)


def _write_export_manifest(
    signer: Ed25519PrivateKey,
    out_path: Path,
    size: int,
    digest: str,
    key: str,
    dtype: str | None,
    tensors: int,
    manifest: Manifest,
) -> Path:
    """Write the signed export manifest beside the output; returns its path."""
    manifest_path, signature_path = export_manifest_paths(out_path)
    document = dumps_canonical(
        {
            "format": EXPORT_FORMAT,
            "file": out_path.name,
            "size": size,
            "blake3": digest,
            "entry": key,
            "dtype": dtype,
            "tensors": tensors,
            "source": {
                "run_id": manifest.run_id,
                "step": manifest.step,
                "generation_id": manifest.generation_id,
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
