"""Which generation a DCP plugin load reads: chosen once, checked on every rank.

The coordinator runs ckptvault's one candidate loop
(:class:`~ckptvault.restoring.selector.CandidateSelector`): newest first, or the
generations of one step. For each candidate it tells the other ranks which one to
try; every rank then applies every check that needs no tensor byte (structure,
file set and sizes, tensor file headers, signature, run id, encryption and keys:
:func:`~ckptvault.io.load.prepare_load`; the non-tensor values stored in the state
tree decode: :mod:`ckptvault.dcp.objects`) on its own view of the store, and the
verdicts are gathered: a problem on any rank rejects the candidate on every rank,
so all ranks read the same generation or all raise the same error. Tensor bytes are
verified later, chunk by chunk, while DCP reads them.

With a ledger the coordinator also holds the choice to the run's floor, the
published generations that vanished and, for a step asked for by name, the newer
generations restore would take first (:mod:`ckptvault.restoring.selector`): it
checks those alone (a rollback is refused whatever the other ranks see).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ckptvault import errors
from ckptvault.coordinator import Coordinator
from ckptvault.dcp.objects import stored_objects, with_objects
from ckptvault.distributed import messages
from ckptvault.distributed.wire import Field
from ckptvault.errors import (
    CheckpointError,
    CollectiveError,
    FormatError,
    NoValidCheckpoint,
    PeerMessageError,
)
from ckptvault.events import RollbackApplied
from ckptvault.format.layout import GenerationName, parse_generation_dirname
from ckptvault.io.dcp_metadata import StoredChunk, metadata_from_json
from ckptvault.io.load import PreparedLoad, prepare_load, rejection
from ckptvault.restoring.rollback import allowed_rollback
from ckptvault.restoring.selector import CandidateSelector, SkippedGeneration
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy
from ckptvault.trust.context import TrustContext
from ckptvault.trust.problems import MANIFEST_INVALID, UNREADABLE, GenerationRejected, Problem


@dataclass(frozen=True)
class Chosen:
    """A generation past every check that needs no tensor byte, ready for DCP."""

    ref: GenerationRef
    prepared: PreparedLoad
    metadata: Metadata
    locations: dict[MetadataIndex, StoredChunk]
    skipped: list[SkippedGeneration]
    rollback: RollbackApplied | None = None  # the coordinator's, allow_rollback_to
    # The state dict's non-tensor values (fqn -> value), decoded from the verified
    # state tree; listed in ``metadata`` as byte entries.
    objects: dict[str, Any] = field(default_factory=dict)


class Chooser:
    """Chooses the generation with the other ranks (see the module docstring)."""

    def __init__(
        self, store: Store, run_id: str, trust: TrustContext, coordinator: Coordinator
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.trust = trust
        self.coordinator = coordinator
        self._unlisted: set[GenerationRef] = set()  # rank 0's choices this rank cannot see
        self._listing: dict[GenerationName, GenerationRef] | None = None  # this rank's

    def choose(
        self, step: int | None, max_fallback: int | None, rollback_to: int | None = None
    ) -> Chosen:
        """The newest generation (of ``step``) that passes on every rank; raises
        ``NoValidCheckpoint`` (listing why each was skipped) on every rank when none
        does, and the coordinator's error on every rank when choosing failed.
        ``rollback_to``: as ``restore(allow_rollback_to=...)`` (with a ledger)."""
        if self.coordinator.is_coordinator:
            return self._lead(step, max_fallback, rollback_to)
        return self._follow()

    # -- the coordinator -------------------------------------------------------------------

    def _lead(self, step: int | None, max_fallback: int | None, rollback_to: int | None) -> Chosen:
        found: dict[GenerationRef, Chosen] = {}

        def load(ref: GenerationRef, policy: TrustPolicy) -> None:
            self.coordinator.broadcast({"try": ref.name.dirname})
            found[ref] = self._check_together(ref, policy)

        def check(ref: GenerationRef, policy: TrustPolicy) -> None:
            self._check(ref, policy)  # a newer generation: the coordinator's view decides

        try:
            selector = CandidateSelector(self.store, self.run_id, self.trust)
            selection = selector.select(step, rollback_to=rollback_to)
            if not selection.candidates:
                raise NoValidCheckpoint(f"store {self.store.location} holds no generation to load")
            ref, _ = selector.first_verified(selection, load, max_fallback, check)
        except PeerMessageError as exc:
            # Every rank raised it alike and waits for this last message: tell them.
            self._tell({"error": [type(exc).__name__, str(exc)]})
            raise
        except CollectiveError:
            raise  # the other ranks are gone or stuck: nothing more to tell them
        except AgreedFailure as failure:
            raise failure.error from None  # every rank raises it already
        except CheckpointError as exc:
            self._tell({"error": [type(exc).__name__, str(exc)]})
            raise
        except BaseException as exc:
            self._tell({"error": ["CheckpointError", f"{type(exc).__name__}: {exc}"]})
            raise
        self._tell({"done": ref.name.dirname})
        rollback = allowed_rollback(selection, ref, self.trust.ledger is not None)
        return dataclasses.replace(found[ref], skipped=selection.skipped, rollback=rollback)

    def _tell(self, message: dict[str, Any]) -> None:
        if self.coordinator.world_size > 1:
            self.coordinator.broadcast(message)

    # -- the other ranks -------------------------------------------------------------------

    def _follow(self) -> Chosen:
        """Check what the coordinator asks for until it is done."""
        policy = self.trust.policy(self.run_id, None)
        last: Chosen | None = None
        refused: PeerMessageError | None = None
        while True:
            message: dict[str, Any] = self.coordinator.broadcast({})
            if "try" in message and refused is None:
                last = None
                ref = self._find(str(message["try"]))
                try:
                    last = self._check_together(ref, policy)
                except GenerationRejected:
                    pass
                except AgreedFailure as failure:
                    raise failure.error from None
                except PeerMessageError as exc:
                    # Raised on every rank alike: rank 0 ends the choice with it; take
                    # that last message (so it is not left waiting), then raise.
                    refused = exc
            elif refused is not None:
                raise refused
            elif "done" in message:
                if last is None or last.ref.name.dirname != message["done"]:
                    raise errors.CollectiveError(
                        f"rank {self.coordinator.rank}: rank 0 chose {message['done']}, "
                        "which this rank did not check"
                    )
                return dataclasses.replace(last, skipped=[])
            else:
                kind, text = message["error"]
                raise _error(kind, f"rank 0: {text}")

    def _find(self, dirname: str) -> GenerationRef:
        """The coordinator's candidate as this rank's store lists it (a placeholder
        that fails the checks when this rank does not see it)."""
        name = parse_generation_dirname(dirname)
        if name is None:
            raise errors.CollectiveError(f"rank 0 named {dirname[:100]!r}, not a generation")
        if self._listing is None:  # one listing per choice, not one per candidate
            self._listing = {ref.name: ref for ref in self.store.list_generations()}
        found = self._listing.get(name)
        if found is not None:
            return found
        placeholder = GenerationRef(name, f"{self.store.location}/{dirname}")
        self._unlisted.add(placeholder)
        return placeholder

    # -- both ------------------------------------------------------------------------------

    def _check_together(self, ref: GenerationRef, policy: TrustPolicy) -> Chosen:
        """Check ``ref`` here, then agree with every rank: GenerationRejected on every
        rank when any rank found a problem (each problem naming its rank), and
        :class:`AgreedFailure` on every rank when one failed for a reason that is not
        the generation's (a destroyed key, a key service down)."""
        chosen: Chosen | None = None
        mine: dict[str, Any] = {"problems": []}
        try:
            chosen = self._check(ref, policy)
            # Every rank must have checked the very same manifest bytes.
            mine["manifest"] = blake3(chosen.prepared.checked.manifest_bytes).hexdigest()
        except GenerationRejected as exc:
            mine["problems"] = [[p.code, p.detail, p.file] for p in exc.problems]
        except (CheckpointError, OSError) as exc:
            found = rejection(ref, exc)
            if isinstance(found, GenerationRejected):
                mine["problems"] = [[p.code, p.detail, p.file] for p in found.problems]
            else:
                mine["fatal"] = [type(exc).__name__, str(exc)[: messages.MAX_REFUSAL_CHARS]]
        # Checked alike on every rank (the same bytes): a malformed verdict is the same
        # PeerMessageError everywhere, before anything in it is used.
        raws = self.coordinator.all_gather(mine)
        gathered = [_verdict(raw, rank) for rank, raw in enumerate(raws)]
        for rank, verdict in enumerate(gathered):
            if "fatal" in verdict:
                kind, text = verdict["fatal"]
                raise AgreedFailure(_error(kind, f"rank {rank}: {text}"))
        problems = [
            Problem(code, f"rank {rank}: {detail}" if len(gathered) > 1 else detail, file)
            for rank, verdict in enumerate(gathered)
            for code, detail, file in verdict["problems"]
        ]
        if len({str(verdict.get("manifest")) for verdict in gathered}) > 1 and not problems:
            problems = [
                Problem(
                    MANIFEST_INVALID,
                    "the ranks read different manifest bytes: it changed while they read it",
                )
            ]
        if problems:
            raise GenerationRejected(ref, problems)
        assert chosen is not None
        return chosen

    def _check(self, ref: GenerationRef, policy: TrustPolicy) -> Chosen:
        if ref in self._unlisted:
            problem = Problem(UNREADABLE, f"{ref.name.dirname} is not listed on this rank")
            raise GenerationRejected(ref, [problem])
        keystore = self.trust.keystore
        prepared = prepare_load(self.store, ref, policy, keystore, keystore is not None)
        where = f"generation {ref.generation_id}"
        try:
            metadata, locations = metadata_from_json(prepared.checked.manifest.dcp, where)
            objects = stored_objects(prepared.checked.manifest, prepared.tree, where)
            metadata = with_objects(metadata, objects)
        except FormatError as exc:
            raise GenerationRejected(ref, [Problem(MANIFEST_INVALID, str(exc))]) from exc
        return Chosen(ref, prepared, metadata, locations, [], objects=objects)


class AgreedFailure(Exception):
    """Every rank knows of ``error`` already: raise it without telling anyone."""

    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error


def _verdict(raw: Any, rank: int) -> dict[str, Any]:
    """A rank's verdict on a candidate, every field checked
    (:mod:`ckptvault.distributed.messages`): ``problems``, and ``fatal`` (an error
    kind and its text) or ``manifest`` (the digest of the bytes it checked)."""
    field = Field(rank, "its verdict on a candidate")
    if not isinstance(raw, dict) or set(raw) not in _VERDICT_KEYS:
        raise field.refuse("not a verdict")
    verdict: dict[str, Any] = {"problems": messages.problems(raw["problems"], rank)}
    if "fatal" in raw:
        verdict["fatal"] = messages.refusal(raw["fatal"], rank)
    if "manifest" in raw:
        verdict["manifest"] = messages.manifest_digest(raw["manifest"], rank)
    return verdict


_VERDICT_KEYS = ({"problems"}, {"problems", "fatal"}, {"problems", "manifest"})


def _error(kind: Any, text: str) -> CheckpointError:
    """An error of the ckptvault kind named ``kind`` (another rank's), or the base."""
    error_type = getattr(errors, str(kind), None)
    if isinstance(error_type, type) and issubclass(error_type, CheckpointError):
        try:
            return error_type(text)
        except TypeError:  # one whose constructor wants more than a message
            pass
    return CheckpointError(text)
