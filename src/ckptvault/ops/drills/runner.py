"""Running drills: choosing them by name, one after another, with progress.

:data:`ALL_DRILLS` is every drill in the order a report lists them: the cheap
damage drills first, the ones with processes and sleeps last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ckptvault.errors import UsageError
from ckptvault.ops.drills.base import Drill, DrillResult
from ckptvault.ops.drills.context import DrillContext
from ckptvault.ops.drills.crash import CRASH_DRILLS
from ckptvault.ops.drills.damage import DAMAGE_DRILLS
from ckptvault.ops.drills.hang import HANG_DRILLS
from ckptvault.ops.drills.memory import MEMORY_DRILLS
from ckptvault.ops.drills.storage import STORAGE_DRILLS
from ckptvault.ops.drills.trust_drills import TRUST_DRILLS

ALL_DRILLS: tuple[Drill, ...] = (
    *DAMAGE_DRILLS,
    *TRUST_DRILLS,
    *STORAGE_DRILLS,
    *MEMORY_DRILLS,
    *CRASH_DRILLS,
    *HANG_DRILLS,
)
DRILL_NAMES = tuple(drill.name for drill in ALL_DRILLS)


def choose_drills(only: Sequence[str] | None = None) -> list[Drill]:
    """The drills named in ``only`` (every drill when None or empty), in report order;
    an unknown name is a ``UsageError`` listing the known ones."""
    if not only:
        return list(ALL_DRILLS)
    unknown = sorted(set(only) - set(DRILL_NAMES))
    if unknown:
        raise UsageError(
            f"unknown drill(s): {', '.join(unknown)}; known drills: {', '.join(DRILL_NAMES)}"
        )
    return [drill for drill in ALL_DRILLS if drill.name in only]


def run_drills(
    context: DrillContext,
    drills: Sequence[Drill],
    on_done: Callable[[DrillResult], None] | None = None,
    on_start: Callable[[Drill], None] | None = None,
) -> list[DrillResult]:
    """Run ``drills`` one after another on ``context``; each gets its own copy of
    the store. ``on_start``/``on_done`` are told about each (a progress display)."""
    results = []
    for drill in drills:
        if on_start is not None:
            on_start(drill)
        result = drill.run(context)
        results.append(result)
        if on_done is not None:
            on_done(result)
    return results
