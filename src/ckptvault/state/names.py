"""Parameter names: the plain form checkpoints use, and renames at restore.

``torch.compile`` wraps a module in an ``OptimizedModule`` whose ``state_dict()``
prefixes every key with ``_orig_mod.`` (and a compiled submodule puts the segment in
the middle of its keys). ckptvault saves the plain names, as DCP's
``get_state_dict`` does, and matches the live module's keys by their plain form at
restore, so checkpoints of compiled and plain models are interchangeable both ways
and an export of a compiled model reads with ``from_pretrained``.

A refactor that renames modules strands old checkpoints: ``restore(...,
rename=...)`` maps checkpoint names to live names, either with a dict of prefixes
(the longest matching prefix wins) or with a callable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ckptvault.errors import UsageError

COMPILED_WRAPPER = "_orig_mod"

Rename = Mapping[str, str] | Callable[[str], str] | None


def plain_name(key: str) -> str:
    """``key`` without the ``_orig_mod`` segments ``torch.compile`` adds."""
    if COMPILED_WRAPPER not in key:
        return key
    return ".".join(part for part in key.split(".") if part != COMPILED_WRAPPER)


def _check_rename(rename: Rename) -> None:
    if rename is None or callable(rename):
        return
    if not isinstance(rename, Mapping) or not all(
        isinstance(old, str) and isinstance(new, str) and old for old, new in rename.items()
    ):
        raise UsageError(
            "rename= takes a dict of non-empty checkpoint-name prefixes to live-name "
            "prefixes (for example {'encoder.layer.': 'encoder.layers.'}) or a callable "
            "from a checkpoint name to a live name"
        )


@dataclass(frozen=True)
class ApplyOptions:
    """How a restore maps checkpoint entries onto live objects.

    ``rename``: checkpoint parameter name -> live name (prefix dict or callable),
    applied to the keys of saved module state. ``strict_dtypes``: refuse a tensor
    whose saved dtype differs from the live one instead of casting it (the default
    casts, as ``load_state_dict`` does, and lists every cast in ``RestoreInfo``).
    ``strict_env``: refuse a generation saved with other software versions or CUDA
    devices (:mod:`ckptvault.state.environment`) instead of warning.
    ``live_entries_only``: the checkpoint's top-level entries that ``state`` does not
    hold are left out rather than unexpected (a validation factory may build only the
    model); what ``state`` holds is matched as strictly as ever. ``in_place``: read
    tensors straight into the live ones after a first pass verified the generation
    (:mod:`ckptvault.io.in_place`; one process).
    """

    rename: Rename = None
    strict_dtypes: bool = False
    strict_env: bool = False
    live_entries_only: bool = False
    in_place: bool = False
    _prefixes: tuple[tuple[str, str], ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        _check_rename(self.rename)
        if isinstance(self.rename, Mapping):
            ordered = sorted(self.rename.items(), key=lambda item: -len(item[0]))
            object.__setattr__(self, "_prefixes", tuple(ordered))

    def renamed(self, name: str) -> str:
        """The live name a checkpoint name maps to (``name`` itself without a rule)."""
        if self.rename is None:
            return name
        if isinstance(self.rename, Mapping):
            for old, new in self._prefixes:
                if name.startswith(old):
                    return new + name[len(old) :]
            return name
        result = self.rename(name)
        if not isinstance(result, str):
            raise UsageError(
                f"the rename= callable returned {type(result).__name__} for {name!r}; it "
                "must return the live name as a str"
            )
        return result
