"""What a writer process that died left published: found, verified, or refused.

The writer process tells the training process each attempt's generation id as soon
as the attempt begins. When the process dies before its reply, the save's outcome
is what the store holds: a generation appears only by the atomic publish at the end
of an attempt, so either that id is listed, and the process died in the instant
after publishing, or nothing of the attempt is. A listed generation is reported as
saved only after the checks restore makes (every rule, every byte): then it is
announced as any other (catalog, ledger, metrics, retention) and the next save
names it as its parent.
"""

from __future__ import annotations

import logging
import time

from ckptvault.errors import SaveFailedError
from ckptvault.saving.generation_writer import GenerationWriter, WrittenGeneration
from ckptvault.storage.listing import GenerationInfo
from ckptvault.trust.checks import verify_generation

logger = logging.getLogger("ckptvault")


def published_by_dead_writer(
    writer: GenerationWriter, generation_id: str | None, step: int, died: str
) -> WrittenGeneration | None:
    """The verified generation ``generation_id`` if the store lists it; None if it
    does not (nothing of the attempt was published). ``died`` says how the process
    died, for messages. Raises SaveFailedError for a listed generation that fails
    verification (restore refuses it too)."""
    if generation_id is None:
        return None
    listed = [ref for ref in writer.store.list_generations() if ref.generation_id == generation_id]
    if not listed:
        return None
    started = time.perf_counter()
    trust, run_id = writer.trust, writer.run_id
    report = verify_generation(writer.store, listed[0], trust.policy(run_id, trust.floor(run_id)))
    if not report.ok or report.manifest is None:
        problems = "; ".join(str(p) for p in report.problems[:3])
        raise SaveFailedError(
            f"the writer process {died} right after publishing generation {generation_id} "
            f"(step {step}), which fails verification ({problems}); restore refuses it"
        )
    manifest = report.manifest
    logger.warning(
        "ckptvault: the writer process %s right after publishing step %d (%s); the "
        "generation verified and counts as saved",
        died,
        step,
        generation_id,
    )
    info = GenerationInfo(
        manifest.step, generation_id, listed[0].location, manifest.stored_bytes, manifest.created_at
    )
    kek_id = manifest.encryption.kek_id if manifest.encryption else None
    return WrittenGeneration(info, time.perf_counter() - started, False, kek_id)
