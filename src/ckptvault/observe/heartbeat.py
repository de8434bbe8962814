"""Progress files: each rank's last heartbeat, for a watchdog to read.

Every ``save()``, ``should_save()`` and ``heartbeat(step)`` of a manager records
progress: the step, the wall time, the process id, the rank and the rank's recent
time per step. While a save runs, the record says so (``phase`` ``"saving"``) and
counts the bytes this process's saves have written (``saved_bytes``): a save that
writes is progress, one whose writes stopped is not. :class:`ProgressWriter` keeps
it in one tiny JSON file per rank, ``rank<R>.json``, in a directory that ``ckptvault
supervise`` names through :data:`PROGRESS_DIR_ENV` (a fresh one for each attempt),
or else in ``progress/<run>/`` beside the ledger (:func:`default_progress_directory`).

Writing is cheap by construction: at most one write per :data:`WRITE_INTERVAL_S`
seconds, whatever the step rate or the bytes a save writes (plus one as a save
starts and one as it ends: :mod:`ckptvault.observe.progress_reporter`); each write
is a whole new file renamed over the old one (a reader never sees half a record;
one thread writes at a time), and never fsynced: a record lost in a power cut is
progress nobody is waiting for any more. A write that fails is logged once and
never fails the training step.

Reading is for a watchdog in another process, and the file is untrusted input:
whoever runs the job can put anything there. :func:`read_progress` opens plain
files only (no symlink, FIFO or device), reads at most :data:`MAX_RECORD_BYTES`,
parses with the bounded JSON loader and type-checks every field; anything else is
a :class:`~ckptvault.errors.FormatError` or
:class:`~ckptvault.errors.UnsafeEntryError`. :func:`scan_progress` reads a whole
directory, at most :data:`MAX_RANK_FILES` of them, and returns the problems beside
the records so that its caller can warn and go on.

No torch here: the supervisor (and the CLI) import this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckptvault.errors import CheckpointError, FormatError
from ckptvault.format.bounded_json import loads_bounded
from ckptvault.io.plain_file import read_plain_file
from ckptvault.trust.ledger import default_state_dir

logger = logging.getLogger("ckptvault")

PROGRESS_DIR_ENV = "CKPTVAULT_PROGRESS_DIR"  # set by ``ckptvault supervise`` per attempt
RECORD_KIND = "ckptvault.progress"
RECORD_VERSION = 2  # 2: phase and saved_bytes
WRITE_INTERVAL_S = 0.5  # at most two writes a second per rank
MAX_RECORD_BYTES = 4096  # a record is ~250 bytes
MAX_RANK_FILES = 4096  # ranks of one node a watchdog reads; more are ignored
MAX_RUN_ID_CHARS = 256
MAX_SAVED_BYTES = 2**63 - 1
PHASES = ("training", "saving")  # what the rank was doing when it last reported
_RANK_FILE = re.compile(r"rank(\d{1,7})\.json")


@dataclass(frozen=True)
class ProgressRecord:
    """One rank's last heartbeat. ``beats`` counts this process's heartbeats (a
    watchdog sees progress when it, or ``saved_bytes``, changes); ``at`` is the
    writer's wall clock; ``step_seconds`` its recent time per step (None before two
    steps); ``phase`` is ``"saving"`` while a save of this process writes, and
    ``saved_bytes`` counts the bytes its saves have written so far."""

    run_id: str
    rank: int
    world_size: int
    pid: int
    step: int
    beats: int
    at: float
    step_seconds: float | None = None
    phase: str = "training"
    saved_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"kind": RECORD_KIND, "version": RECORD_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> ProgressRecord:
        """Type-check a parsed record; :class:`FormatError` names what is wrong."""
        if not isinstance(raw, dict) or raw.get("kind") != RECORD_KIND:
            raise FormatError(f"{where}: not a ckptvault progress record")
        if raw.get("version") != RECORD_VERSION:
            raise FormatError(
                f"{where}: progress record version {raw.get('version')!r} is not "
                f"{RECORD_VERSION}: the job runs another ckptvault version than the watchdog"
            )
        fields = {k: v for k, v in raw.items() if k not in ("kind", "version")}
        try:
            record = cls(**fields)
        except TypeError as exc:
            raise FormatError(
                f"{where}: missing or unknown fields in a progress record: {exc}"
            ) from None
        problem = record._type_problem()
        if problem:
            raise FormatError(f"{where}: {problem}")
        return record

    def _type_problem(self) -> str | None:
        for name in ("rank", "world_size", "pid", "step", "beats", "saved_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return f"field {name} must be a non-negative integer, not {value!r}"
        if not isinstance(self.run_id, str) or len(self.run_id) > MAX_RUN_ID_CHARS:
            return f"field run_id must be a string of at most {MAX_RUN_ID_CHARS} characters"
        for name in ("at", "step_seconds"):
            value = getattr(self, name)
            if value is None and name == "step_seconds":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return f"field {name} must be a number, not {value!r}"
            # The range first: comparing an int to a float is exact, while math.isfinite
            # of a JSON integer past float's range (10**400) raises OverflowError.
            if not 0 <= value <= sys.float_info.max or not math.isfinite(value):
                return f"field {name} must be finite and not negative, not {value!r}"
        if self.phase not in PHASES:
            return f"field phase must be one of {', '.join(PHASES)}, not {str(self.phase)[:40]!r}"
        if self.saved_bytes > MAX_SAVED_BYTES:
            return f"field saved_bytes must be at most {MAX_SAVED_BYTES}"
        return None


def progress_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.json"


def default_progress_directory(run_id: str, ledger: str | os.PathLike[str] | None) -> Path:
    """Where an unsupervised run's ranks record progress: ``progress/<run>/`` beside
    the ledger (given, or the per-user state directory's). The run's directory name
    is its id made safe for a file name, plus a digest of the id (two ids that read
    alike never share a directory)."""
    base = Path(ledger).parent if ledger is not None else default_state_dir()
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:64].lstrip(".") or "run"
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return base / "progress" / f"{safe}-{digest}"


def progress_directory(run_id: str, ledger: str | os.PathLike[str] | None) -> Path:
    """The supervisor's directory (:data:`PROGRESS_DIR_ENV`) when set, else the
    default beside the ledger."""
    given = os.environ.get(PROGRESS_DIR_ENV)
    return Path(given) if given else default_progress_directory(run_id, ledger)


class ProgressWriter:
    """Writes one rank's :class:`ProgressRecord`, at most once per ``interval_s``.

    :meth:`offer` is called at every heartbeat, and by a save's writer threads as
    they write; it writes only when the last write is ``interval_s`` old (the first
    always). Safe from any thread: one writes at a time, and a call that finds
    another writing returns at once (a record is being written right then).
    ``clock`` is monotonic seconds.
    """

    def __init__(
        self,
        directory: Path,
        rank: int,
        interval_s: float = WRITE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = progress_file(directory, rank)
        self.interval_s, self._clock = interval_s, clock
        self._last_write: float | None = None
        self._warned = False
        self._lock = threading.Lock()
        self.last: ProgressRecord | None = None  # the record last written
        self.writes = 0  # files written (tests count them)

    def offer(self, record: Callable[[], ProgressRecord], *, force: bool = False) -> bool:
        """Write ``record()`` if the last write is old enough (``force``: whatever its
        age, waiting for a write in progress); whether it wrote. A failure is logged
        (once) and returns False: progress is never worth a failed training step."""
        if not self._lock.acquire(blocking=force):
            return False  # another thread is writing a record right now
        try:
            now = self._clock()
            last = self._last_write
            if not force and last is not None and now - last < self.interval_s:
                return False
            self._last_write = now
            written = record()
            try:
                self._replace(_encode(written))
            except OSError as exc:
                self._warn(exc)
                return False
            self.last = written
            self.writes += 1
            return True
        finally:
            self._lock.release()

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "ckptvault: cannot record progress in %s (%s); a hang watchdog "
                "(ckptvault supervise --hang-timeout) will not see this rank progress",
                self.path,
                exc.strerror or exc,
            )

    def _replace(self, data: bytes) -> None:
        _make_private_dirs(self.path.parent)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o600)
        try:
            os.write(fd, data)  # a few hundred bytes: one write
        finally:
            os.close(fd)
        os.replace(temporary, self.path)


def _encode(record: ProgressRecord) -> bytes:
    import json

    return json.dumps(record.to_json(), sort_keys=True, allow_nan=False).encode()


def read_progress(path: Path) -> ProgressRecord:
    """The record at ``path``: :class:`UnsafeEntryError` for anything but a plain
    file, :class:`FormatError` for a record that is not valid, ``OSError`` (e.g.
    ``FileNotFoundError``) when it cannot be opened."""
    where = f"progress file {path}"
    hint = "the watchdog ignores it (only the job's manager writes these records)"
    data = read_plain_file(path, MAX_RECORD_BYTES + 1, where, hint)
    raw = loads_bounded(data, where, max_depth=4, max_bytes=MAX_RECORD_BYTES)
    return ProgressRecord.from_json(raw, where)


def scan_progress(directory: Path) -> tuple[list[ProgressRecord], list[str]]:
    """Every rank's record in ``directory`` (none when it does not exist yet) and a
    message for each file that could not be read (the caller warns and goes on).
    A record whose rank is not its file's is a problem too: one rank cannot speak
    for another."""
    records: list[ProgressRecord] = []
    problems: list[str] = []
    try:
        entries = [e.name for e in os.scandir(directory) if _RANK_FILE.fullmatch(e.name)]
    except FileNotFoundError:
        return records, problems
    except OSError as exc:
        return records, [f"cannot list the progress directory {directory}: {exc}"]
    if len(entries) > MAX_RANK_FILES:
        problems.append(f"{directory} holds {len(entries)} rank files; reading {MAX_RANK_FILES}")
    for name in sorted(entries)[:MAX_RANK_FILES]:
        try:
            record = read_progress(directory / name)
        except FileNotFoundError:
            continue  # replaced between the listing and the open: read it next time
        except (OSError, CheckpointError) as exc:
            problems.append(str(exc))
            continue
        match = _RANK_FILE.fullmatch(name)
        if match is None or int(match.group(1)) != record.rank:
            problems.append(f"progress file {directory / name} names rank {record.rank}")
            continue
        records.append(record)
    return records, problems


def _make_private_dirs(directory: Path) -> None:
    """``directory`` and every missing ancestor, each made ``0o700``.

    ``Path.mkdir(parents=True, mode=...)`` gives missing parents the default mode: the
    progress directory sits in the per-user state directory, which it may create
    first, and that directory (ledger, catalog, audit log) must be private."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another rank made it meanwhile
            path.mkdir(mode=0o700)
