"""The restore plan: what applying a checkpoint will do, found before anything runs.

:func:`ckptvault.state.apply.plan_restore` fills a :class:`RestorePlan` with
:class:`Action` s and with every missing, unexpected and mismatched entry; the
caller decides whether an unclean plan is an error (:meth:`RestorePlan.mismatch_error`)
and then runs it (:meth:`RestorePlan.apply`) in the order :mod:`ckptvault.state.apply`
documents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ckptvault.errors import StateMismatchError


@dataclass(frozen=True)
class Action:
    """One step of applying a plan; ``where`` names the entry it changes."""

    where: str
    run: Callable[[], None]

    def __call__(self) -> None:
        self.run()


def unwritable(live: torch.Tensor) -> str | None:
    """Why ``live.copy_(...)`` of a dense tensor would refuse ``live`` (not dense, an
    inference tensor, elements sharing memory), or None: found while planning,
    so that a restore refuses before it changes anything rather than half-way
    through applying. (Inside ``torch.inference_mode`` an inference tensor takes
    writes; a contiguous tensor never shares memory between its elements.)"""
    if live.layout != torch.strided:
        return (
            f"cannot be written in place: it is a {live.layout} tensor, the checkpoint's is dense"
        )
    if live.is_inference() and not torch.is_inference_mode_enabled():
        return (
            "cannot be written in place: it is an inference tensor (made under "
            "torch.inference_mode); build it outside inference mode, or clone it"
        )
    if not live.is_contiguous() and any(
        stride == 0 and size > 1 for size, stride in zip(live.shape, live.stride(), strict=True)
    ):
        return "cannot be written in place: its elements share memory (an expanded view); clone it"
    return None


class TensorCopies:
    """Many in-place tensor copies as one action: one ``torch.no_grad()`` for all of
    them rather than one each (at 10,000 tensors, a third of applying them).
    ``where`` names the entry being copied, so a failure names it as an
    :class:`Action` would."""

    def __init__(self) -> None:
        self.copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.where = "a tensor"

    def add(self, where: str, live: torch.Tensor, saved: torch.Tensor) -> None:
        self.copies.append((where, live, saved))

    def __call__(self) -> None:
        with torch.no_grad():
            for where, live, saved in self.copies:
                self.where = where
                live.copy_(saved)


@dataclass
class RestorePlan:
    # Run in this order by apply(): loads and tensor copies, then the contents of
    # plain containers, then the RNG-like states.
    actions: list[Callable[[], None]] = field(default_factory=list)
    replacements: list[Callable[[], None]] = field(default_factory=list)
    rng_actions: list[Callable[[], None]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    # Problems that refuse the restore even with strict=False (an object none of
    # whose state matches would otherwise be left untouched while others load).
    refused: list[str] = field(default_factory=list)
    # What the plan loads, casts and renames, for RestoreInfo.
    loaded: list[str] = field(default_factory=list)
    casts: list[str] = field(default_factory=list)
    renamed: list[str] = field(default_factory=list)
    _copies: TensorCopies | None = field(default=None, repr=False, compare=False)

    def copy_tensor(self, where: str, live: torch.Tensor, saved: torch.Tensor) -> None:
        """Plan ``live.copy_(saved)`` (without autograd), among the first actions."""
        if self._copies is None:
            self._copies = TensorCopies()
            self.actions.append(self._copies)
        self._copies.add(where, live, saved)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def apply(self, where: str = "the checkpoint") -> None:
        """Run every action, in the order :mod:`ckptvault.state.apply` gives. Planning checked
        everything it can; whatever still fails here is re-raised as a typed error
        naming the entry (the objects' own code may refuse a value)."""
        for action in (*self.actions, *self.replacements, *self.rng_actions):
            try:
                action()
            except Exception as exc:
                entry = action.where if isinstance(action, (Action, TensorCopies)) else "an entry"
                message = " ".join(str(exc).split())[:500]
                failure = StateMismatchError(
                    f"restoring {where} failed while loading {entry} into the live objects "
                    f"({type(exc).__name__}: {message}); state may be partially restored. "
                    "Rebuild the objects and restore again, or restore with the layout the "
                    "run was saved with.",
                    mismatched=[entry],
                )
                raise failure from exc

    def refusal_error(self, where: str) -> StateMismatchError:
        """The error for a plan with :attr:`refused` entries (raised whatever ``strict``)."""
        return StateMismatchError(
            f"{where} cannot be restored into these objects, even with strict=False: "
            + "; ".join(self.refused[:5])
            + (f"; ... ({len(self.refused)} in all)" if len(self.refused) > 5 else "")
            + ". Nothing was restored.",
            mismatched=self.refused,
        )

    def mismatch_error(self, where: str) -> StateMismatchError:
        parts = []
        for label, items in (
            ("missing from the checkpoint", self.missing),
            ("in the checkpoint but not in state", self.unexpected),
            ("mismatched", self.mismatched),
        ):
            if items:
                shown = ", ".join(items[:20]) + (
                    f", ... ({len(items)} in all)" if len(items) > 20 else ""
                )
                parts.append(f"{label}: {shown}")
        return StateMismatchError(
            f"{where} does not match the objects being restored into; "
            + "; ".join(parts)
            + ". Build the same model/optimizer layout as the saved run, or pass "
            "strict=False to load what matches.",
            missing=self.missing,
            unexpected=self.unexpected,
            mismatched=self.mismatched,
        )
