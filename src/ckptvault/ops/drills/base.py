"""What a drill is, what it reports, and how a restore is timed.

A :class:`Drill` names one recovery scenario, states the outcome it expects and runs
it against a :class:`~ckptvault.ops.drills.context.DrillContext` (a scratch copy of a
store). Its :class:`DrillResult` says whether the outcome was the expected one
(``passed``: True/False, or None with a ``skipped`` reason when the drill cannot run
on this machine), what was observed, and how long recovery took, split into the
restore stages the ``Restored``/``Refused`` events carry. A drill never raises: an
unexpected exception is a failed drill that names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptvault.events import Event, Refused, Restored

if TYPE_CHECKING:
    from ckptvault.manager import CheckpointManager
    from ckptvault.ops.drills.context import DrillContext
    from ckptvault.restoring.restorer import RestoreInfo

# The restore stages (ckptvault.events) and the JSON keys they are reported under.
STAGE_KEYS = {
    "discovery": "discovery_s",
    "verification": "verification_s",
    "read": "read_s",
    "apply": "apply_s",
}


def has_code(reason: str, code: str) -> bool:
    """Whether a refusal reason (``"code: detail; code: detail"``) carries ``code``."""
    return reason.startswith(f"{code}:") or f"; {code}:" in reason


class DrillSkipped(Exception):
    """Raised by a drill that cannot run here; the message is the reason."""


@dataclass
class DrillResult:
    """One drill's outcome. ``timings`` are seconds, keyed without the ``_s`` suffix."""

    name: str
    expected: str
    passed: bool | None
    observed: str
    timings: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: name, passed, expected, observed, ``*_s`` timings,
        and ``skipped`` (only when the drill could not run)."""
        record: dict[str, Any] = {
            "name": self.name,
            "passed": self.passed,
            "expected": self.expected,
            "observed": self.observed,
        }
        for key, seconds in sorted(self.timings.items()):
            record[f"{key}_s"] = round(seconds, 6)
        if self.skipped is not None:
            record["skipped"] = self.skipped
        return record


@dataclass(frozen=True)
class Drill:
    """One recovery scenario: ``body`` makes the fault on the context's scratch
    copy, recovers, and returns ``(passed, observed, timings)``."""

    name: str
    expected: str
    body: Callable[[DrillContext], tuple[bool, str, dict[str, float]]]

    def run(self, context: DrillContext) -> DrillResult:
        """Run the drill; never raises (a crash of the drill itself is a failure)."""
        try:
            passed, observed, timings = self.body(context)
        except DrillSkipped as skip:
            return DrillResult(self.name, self.expected, None, "not run", skipped=str(skip))
        except Exception as exc:  # the drill's own fault, or a recovery path that broke
            observed = f"the drill raised {type(exc).__name__}: {' '.join(str(exc).split())}"
            return DrillResult(self.name, self.expected, False, observed[:1000])
        return DrillResult(self.name, self.expected, passed, observed, timings)


@dataclass
class RestoreOutcome:
    """What one timed ``restore`` did: its info, or the error it raised, and timings."""

    info: RestoreInfo | None
    error: Exception | None
    timings: dict[str, float]

    @property
    def skipped_reasons(self) -> list[str]:
        """Why each generation the restore skipped (or, when it raised, every
        generation it tried) was refused, newest first: ``"code: detail; ..."``."""
        if self.info is not None:
            return [s.reason for s in self.info.skipped]
        return [reason for _gen, _step, reason in getattr(self.error, "rejected", [])]

    def describe(self) -> str:
        if self.error is not None:
            first = str(self.error).splitlines()[0] if str(self.error) else ""
            return f"{type(self.error).__name__}: {first[:300]}"
        if self.info is None:
            return "restore found no generation at all"
        skipped = ", ".join(f"step {s.step} ({s.reason.split(':')[0]})" for s in self.info.skipped)
        return f"restored step {self.info.step}" + (f" after skipping {skipped}" if skipped else "")


def timed_restore(
    manager: CheckpointManager, state: MutableMapping[str, Any], strict: bool, **options: Any
) -> RestoreOutcome:
    """``manager.restore(state, ...)``, timed by its own ``Restored``/``Refused``
    event (discovery, verification, read, apply; ``recovery`` the whole call).
    Checkpoint errors are returned, not raised: a drill often expects one."""
    events: list[Event] = []
    manager.events.subscribe(events.append)
    started = time.perf_counter()
    info: RestoreInfo | None = None
    error: Exception | None = None
    try:
        info = manager.restore(state, strict=strict, **options)
    except Exception as exc:  # typed errors are outcomes here; the caller checks which
        error = exc
    timings = {"recovery": time.perf_counter() - started}
    for event in events:
        if isinstance(event, (Restored, Refused)):
            timings["recovery"] = event.seconds
            for stage, seconds in event.stages.items():
                if stage in STAGE_KEYS:
                    timings[stage] = seconds
    return RestoreOutcome(info, error, timings)
