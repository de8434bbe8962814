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

Undo = Callable[[], None]


@dataclass(frozen=True)
class Action:
    """One step of applying a plan; ``where`` names the entry it changes.
    ``snapshot``, called just before the step runs, returns what puts the entry back
    as it was; a step without one (an in-place tensor copy) cannot be undone."""

    where: str
    run: Callable[[], None]
    snapshot: Callable[[], Undo] | None = None

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
        self.done = 0

    def add(self, where: str, live: torch.Tensor, saved: torch.Tensor) -> None:
        self.copies.append((where, live, saved))

    def __call__(self) -> None:
        with torch.no_grad():
            for done, (where, live, saved) in enumerate(self.copies):
                self.where, self.done = where, done
                live.copy_(saved)
        self.done = len(self.copies)

    def written(self) -> list[str]:
        """The entries copied so far (all of them once the copies ran)."""
        return [where for where, _, _ in self.copies[: self.done]]


@dataclass
class RestorePlan:
    # Run in this order by apply(): loads into objects that can be undone (optimizers,
    # schedulers and other stateful objects: what a user's own code may still refuse),
    # in-place loads and tensor copies, the contents of plain containers, the RNG-like
    # states.
    object_loads: list[Action] = field(default_factory=list)
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
    # (saved tensor, live tensor): where applying puts each saved tensor's values, in
    # place (a copy into a live tensor, a module's parameter or buffer) or into the
    # same slot (an optimizer's state). A restore with ``in_place=True`` reads the
    # saved bytes straight into such a live tensor (:mod:`ckptvault.io.in_place`).
    targets: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _copies: TensorCopies | None = field(default=None, repr=False, compare=False)

    def copy_tensor(self, where: str, live: torch.Tensor, saved: torch.Tensor) -> None:
        """Plan ``live.copy_(saved)`` (without autograd), among the first actions."""
        if self._copies is None:
            self._copies = TensorCopies()
            self.actions.append(self._copies)
        self._copies.add(where, live, saved)
        self.targets.append((saved, live))

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def apply(self, where: str = "the checkpoint") -> None:
        """Run every action, in the order :mod:`ckptvault.state.apply` gives. Planning
        checked everything it can; whatever still fails here (an object's own code
        may refuse a value, a device may fail) is re-raised as a typed error naming
        the entry, after every step already run that can be undone is put back."""
        undos: list[tuple[str, Undo]] = []
        written: list[str] = []  # in-place steps already run: no undo
        steps: list[Callable[[], None]] = [
            *self.object_loads,
            *self.actions,
            *self.replacements,
            *self.rng_actions,
        ]
        for action in steps:
            snapshot = action.snapshot if isinstance(action, Action) else None
            try:
                undo: Undo | None = snapshot() if snapshot is not None else None
                action()
            except Exception as exc:
                entry = action.where if isinstance(action, (Action, TensorCopies)) else "an entry"
                if isinstance(action, TensorCopies):
                    written += action.written()
                elif snapshot is None:  # an in-place load may have written part of it
                    written.append(entry)
                kept = _undo_all(undos)
                raise _apply_failure(where, entry, exc, written + kept) from exc
            name = action.where if isinstance(action, Action) else "tensors"
            if undo is not None:
                undos.append((name, undo))
            else:
                written += action.written() if isinstance(action, TensorCopies) else [name]

    def refusal_error(self, where: str) -> StateMismatchError:
        """The error for a plan with :attr:`refused` entries (raised whatever ``strict``)."""
        return StateMismatchError(
            f"{where} cannot be restored into these objects, even with strict=False: "
            + "; ".join(self.refused[:5])
            + (f"; ... ({len(self.refused)} in all)" if len(self.refused) > 5 else "")
            + ". Nothing was restored: restore into objects built as the saved run's were "
            "(the same model, optimizer and engine configuration), or another generation.",
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


def _undo_all(undos: list[tuple[str, Undo]]) -> list[str]:
    """Put back every undoable step, newest first; the entries that would not go back."""
    stuck = []
    for name, undo in reversed(undos):
        try:
            undo()
        except Exception:  # keep undoing the rest; the error names this entry
            stuck.append(name)
    return stuck


def _apply_failure(
    where: str, entry: str, exc: Exception, changed: list[str]
) -> StateMismatchError:
    message = " ".join(str(exc).split())[:500]
    if not changed:
        outcome = "nothing was restored (what had loaded before it was put back)"
    else:
        shown = ", ".join(changed[:5]) + (
            f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        )
        outcome = (
            f"what could be undone was put back, but {shown} already hold the checkpoint's "
            "values (copied in place): rebuild those objects before restoring again"
        )
    return StateMismatchError(
        f"restoring {where} failed while loading {entry} into the live objects "
        f"({type(exc).__name__}: {message}); {outcome}. Restore with the layout the run "
        "was saved with, or fix what refused the value.",
        mismatched=[entry],
    )
