"""Starting a run from another run's checkpoint (fine-tuning from pretraining).

A restore only ever takes the manager's own run (another run's generation is
``run-mismatch``). :func:`warm_start` takes a generation of *another* run, in
another store, under that run's trust policy (its trusted keys and key store), and
never writes to that store: no lease, no mark, no ledger floor, no audit entry
there. What matches the live state is applied under the caller's ``strict``,
``rename`` and dtype rules (:mod:`ckptvault.state.apply`). The source run, step and
generation become the new run's :class:`~ckptvault.restoring.lineage.Lineage`, recorded in the contract of every
manifest it writes from then on (and carried forward by its own restores).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptvault.config import validate_step
from ckptvault.errors import UsageError
from ckptvault.io.load import LoadedGeneration, load_verified
from ckptvault.restoring.hf_weights import is_weights_source, read_weights
from ckptvault.restoring.lineage import Lineage
from ckptvault.restoring.restorer import RestoreInfo
from ckptvault.restoring.selector import CandidateSelector, SkippedGeneration
from ckptvault.state.apply import checked_plan
from ckptvault.state.capture import MODULE, StatefulPayload, type_name
from ckptvault.state.names import ApplyOptions
from ckptvault.storage import StoreLocation, open_store
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.s3.options import S3Options
from ckptvault.trust.checks import TrustPolicy
from ckptvault.trust.context import TrustContext, _trusted_keys
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.keystores import open_keystore
from ckptvault.trust.signing import PublicKeyLike


@dataclass(frozen=True)
class WarmStartSource:
    """The other run: its store (read only), run id, trust policy, and which step."""

    store: StoreLocation
    run_id: str | None  # None: Hugging Face weights (hf_weights.is_weights_source)
    step: int | None = None
    trusted_keys: Iterable[PublicKeyLike] | PublicKeyLike | None = None
    keystore: str | KeyStore | None = None
    s3: S3Options | None = None


def load_source(
    source: WarmStartSource, threads: int
) -> tuple[LoadedGeneration, list[SkippedGeneration]]:
    """The newest generation of the source run (of ``source.step``) that passes every
    check under the source's trust policy, verified and decoded, and the newer ones
    skipped on the way (each with its reason). Reads only."""
    if not isinstance(source.run_id, str) or not source.run_id:
        raise UsageError(
            f"warm_start from {source.store!r} needs source_run_id=, the run id of the "
            "source run (Hugging Face weights are a save_pretrained directory or a "
            ".safetensors file)"
        )
    step = None if source.step is None else validate_step(source.step)
    store = open_store(source.store, must_exist=True, s3=source.s3)
    keystore = open_keystore(source.keystore) if source.keystore is not None else None
    # No ledger and no audit log: nothing is recorded about, or in, the other run.
    trust = TrustContext(trusted=_trusted_keys(source.trusted_keys), keystore=keystore)
    selector = CandidateSelector(store, source.run_id, trust)
    selection = selector.select(step, floor_applies=False)

    def attempt(ref: GenerationRef, policy: TrustPolicy) -> LoadedGeneration:
        return load_verified(store, ref, policy, keystore, threads, keystore is not None)

    return selector.first_verified(selection, attempt)[1], selection.skipped


def warm_start(
    state: MutableMapping[str, Any],
    source: WarmStartSource,
    threads: int,
    strict: bool,
    options: ApplyOptions,
) -> RestoreInfo:
    """Load the source generation and apply what matches to ``state``, all or
    nothing as a restore; ``RestoreInfo.lineage`` names the source. Without a run id
    the source is Hugging Face weights (:func:`warm_start_from_weights`)."""
    if source.run_id is None and is_weights_source(source.store):
        return warm_start_from_weights(state, os.fspath(source.store), strict, options)
    loaded, skipped = load_source(source, threads)
    assert source.run_id is not None  # load_source refuses a source without one
    ref = loaded.ref
    where = f"generation {ref.generation_id} (step {ref.step}) of run {source.run_id}"
    plan = checked_plan(state, loaded.saved, loaded.reset, options, strict, where)
    plan.apply(where)
    return RestoreInfo(
        step=ref.step,
        generation_id=ref.generation_id,
        path=ref.location,
        skipped=skipped,  # a fallback past a damaged newest is said, as restore says it
        missing=plan.missing,
        unexpected=plan.unexpected,
        mismatched=plan.mismatched,
        bytes=loaded.manifest.total_bytes,
        signer=loaded.signer,
        reset=loaded.reset,
        loaded=plan.loaded,
        casts=plan.casts,
        renamed=plan.renamed,
        lineage=Lineage(source.run_id, ref.step, ref.generation_id, str(ref.location)),
    )


def warm_start_from_weights(
    state: MutableMapping[str, Any], source: str, strict: bool, options: ApplyOptions
) -> RestoreInfo:
    """Load Hugging Face weights (:mod:`ckptvault.restoring.hf_weights`) into the one
    module ``state`` holds, all or nothing as a restore: strict over that module's
    state dict (its other entries are left as they are), ``rename``: file name ->
    module name. A tied name the file leaves out (``save_pretrained`` writes one of
    each tie) takes its partner's tensor. ``RestoreInfo.lineage`` lists the files."""
    modules = [key for key, value in state.items() if isinstance(value, torch.nn.Module)]
    if len(modules) != 1:
        raise UsageError(
            f"warm_start from Hugging Face weights loads one module, and state holds "
            f"{len(modules)} ({', '.join(map(repr, modules)) or 'none'}): pass "
            "{'model': model} (and the rest), or load the others separately"
        )
    entry = modules[0]
    tensors, files = read_weights(source)
    tensors = _with_ties(state[entry], tensors, options)
    where = f"the Hugging Face weights at {source}"
    saved = {entry: StatefulPayload(MODULE, type_name(state[entry]), tensors)}
    others = [key for key in state if key != entry]
    plan = checked_plan(state, saved, others, options, strict, where)
    plan.apply(where)
    names = tuple((file.path.name, file.blake3) for file in files)
    return RestoreInfo(
        step=0,
        generation_id="",
        path=source,
        skipped=[],
        missing=plan.missing,
        unexpected=plan.unexpected,
        mismatched=plan.mismatched,
        bytes=sum(file.bytes for file in files),
        signer=None,
        reset=[],
        loaded=plan.loaded,
        casts=plan.casts,
        renamed=plan.renamed,
        lineage=Lineage("", 0, "", source, names),
    )


def _with_ties(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor], options: ApplyOptions
) -> dict[str, torch.Tensor]:
    """``tensors`` plus, for each live name tied to another (the same storage) that the
    file leaves out, its partner's tensor under the file's naming."""
    live = module.state_dict(keep_vars=True)
    by_storage: dict[tuple[int, int], list[str]] = {}
    for name, value in live.items():
        if isinstance(value, torch.Tensor) and value.numel():
            key = (value.untyped_storage().data_ptr(), int(value.storage_offset()))
            by_storage.setdefault(key, []).append(name)
    present = {options.renamed(name): name for name in tensors}
    added = dict(tensors)
    for names in by_storage.values():
        found = next((present[n] for n in names if n in present), None)
        if found is None:
            continue
        for name in names:
            if name not in present:
                added[name] = tensors[found]
    return added
