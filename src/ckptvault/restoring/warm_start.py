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

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from ckptvault.config import validate_step
from ckptvault.errors import UsageError
from ckptvault.io.load import LoadedGeneration, load_verified
from ckptvault.restoring.lineage import Lineage
from ckptvault.restoring.restorer import RestoreInfo
from ckptvault.restoring.selector import CandidateSelector, SkippedGeneration
from ckptvault.state.apply import checked_plan
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
    run_id: str
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
        raise UsageError("warm_start needs source_run_id=, the run id of the source run")
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
    nothing as a restore; ``RestoreInfo.lineage`` names the source."""
    loaded, skipped = load_source(source, threads)
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
