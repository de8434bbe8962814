"""Which generations the other tiers of a plan can vouch for.

One retention policy over two tiers is planned from the first and applied to both
(:mod:`ckptvault.replication.tiers`). A generation that takes a rule's place there
decides what the rule drops in *every* tier. So, in each other tier, it must be
there and pass the checks restore applies before reading a tensor byte
(:func:`~ckptvault.trust.checks.check_trusted`): otherwise whoever can write the
first tier alone (a generation planted there, in a run with nothing to authenticate
it) could make retention delete genuine generations from a replica they cannot
write. :class:`TierVouching` says, per generation, why some tier cannot vouch for it
(:attr:`~ckptvault.retention.decisions.GenerationFacts.unvouched`); the planner
counts only the others.

Each tier is listed once per pass; a copy's checks are made once (generations are
immutable) and only for generations a rule would keep. A tier that cannot be listed
fails the pass: nothing is deleted anywhere until it can be, rather than deleting by
a guess about what it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckptvault.errors import CheckpointError
from ckptvault.format.layout import GenerationName
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy, check_trusted
from ckptvault.trust.problems import UNREADABLE, GenerationRejected


class TierVouching:
    """The other ``tiers`` of a plan and what each holds (see the module docstring)."""

    def __init__(self, tiers: Sequence[Store], policy: TrustPolicy) -> None:
        self.tiers = list(tiers)
        self.policy = policy
        self._listed: dict[str, dict[GenerationName, GenerationRef]] = {}
        self._verdicts: dict[tuple[str, GenerationName], str | None] = {}  # why not, or None
        self._transient: dict[tuple[str, GenerationName], str] = {}  # this pass only

    def list_tiers(self) -> None:
        """List every tier (once per pass); raises what listing raises."""
        self._transient = {}
        self._listed = {
            tier.location: {ref.name: ref for ref in tier.list_generations()} for tier in self.tiers
        }

    def holds(self, tier: Store, name: GenerationName) -> bool:
        """Whether ``tier`` listed a copy of ``name`` in this pass."""
        return name in self._listed.get(tier.location, {})

    def unvouched(self, name: GenerationName) -> str | None:
        """Why some tier cannot vouch for ``name`` as far as is known: it holds no copy,
        or its copy failed the checks. None when every tier holds a copy that passed or
        was not checked yet (:meth:`check`)."""
        for tier in self.tiers:
            if name not in self._listed.get(tier.location, {}):
                return f"{tier.location} holds no copy"
            key = (tier.location, name)
            why = self._verdicts.get(key) or self._transient.get(key)
            if why is not None:
                return f"its copy in {tier.location} fails: {why}"
        return None

    def check(self, names: Iterable[GenerationName]) -> bool:
        """Check every tier's copy of ``names`` not checked before; whether any fails."""
        failed = False
        for name in names:
            for tier in self.tiers:
                ref = self._listed.get(tier.location, {}).get(name)
                key = (tier.location, name)
                if ref is None or key in self._verdicts or key in self._transient:
                    continue
                try:
                    check_trusted(tier, ref, self.policy)
                    self._verdicts[key] = None
                except GenerationRejected as rejected:
                    why = ", ".join(sorted(rejected.codes))
                    if UNREADABLE in rejected.codes:  # perhaps for now only
                        self._transient[key] = why
                    else:
                        self._verdicts[key] = why
                    failed = True
                except (CheckpointError, OSError) as exc:
                    # Cannot be read now: it decides nothing this pass; asked again next.
                    self._transient[key] = f"could not be checked: {exc}"
                    failed = True
        return failed
