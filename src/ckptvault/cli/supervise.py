"""``ckptvault supervise [OPTIONS] -- CMD ARGS...``: run a training job, restart it
after a failure within a bounded budget, and check its DONE record.

The policy and the process handling live in :mod:`ckptvault.ops.supervise`; this
module parses options, opens the store for the DONE check, and returns the
supervisor's exit status (see "Supervising a job" in docs/guides/operations.md for
the table).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from ckptvault.cli._common import S3EndpointUrl
from ckptvault.errors import UsageError
from ckptvault.observe.catalog import default_catalog_path
from ckptvault.observe.catalog_attempts import attempt_recorder
from ckptvault.ops.done import DoneExpectation, file_digest
from ckptvault.ops.hang import HangPolicy
from ckptvault.ops.preflight import free_space_preflight
from ckptvault.ops.supervise import Policy, Supervisor
from ckptvault.storage import S3Options, local_path, open_store
from ckptvault.storage.base import Store
from ckptvault.trust.ledger import default_ledger_path

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``1.5T``, ``4096``: bytes, with 1024-based suffixes."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise UsageError(f"--min-free-bytes {text!r}: give bytes, optionally with K, M, G or T")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def parse_backoff(text: str) -> tuple[float, ...]:
    """``10,20,40`` → (10.0, 20.0, 40.0); :class:`UsageError` for anything else."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(
            f"--backoff {text!r}: give seconds separated by commas, e.g. 10,20,40"
        ) from None


def local_store_path(location: str) -> Path | None:
    """The local directory of a store location (a path or ``file://`` URL); None for
    a remote store (``s3://``, ``az://``), whose free space cannot be asked for."""
    return local_path(location)


@contextmanager
def _progress_root(hang: HangPolicy | None) -> Iterator[Path | None]:
    """A private temporary directory for the attempts' progress files (None without
    a hang watchdog): each attempt gets a fresh directory in it."""
    if hang is None:
        yield None
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckptvault-progress-") as directory:
        yield Path(directory)


@contextmanager
def _done_path(given: Path | None) -> Iterator[Path]:
    """``--done-file``, or a fresh path in a private temporary directory for this run."""
    if given is not None:
        yield given
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckptvault-supervise-") as directory:
        yield Path(directory) / "DONE.json"


Command = Annotated[
    list[str] | None,
    typer.Argument(help="The training command and its arguments, after --.", metavar="CMD"),
]
MaxRestarts = Annotated[
    int,
    typer.Option(
        help="Failed attempts retried: at most 1 + N attempts in all (default 2: 3 "
        "attempts). Preemptions (exit 75) do not count."
    ),
]
Backoff = Annotated[
    str, typer.Option(help="Seconds to wait after failure 1, 2, ...; the last value repeats.")
]
MaxPreemptions = Annotated[
    int, typer.Option(help="Restarts after exit 75 (preempted) allowed before giving up.")
]
GraceSeconds = Annotated[
    float, typer.Option(help="After SIGTERM/SIGINT, how long the job may take before SIGKILL.")
]
StopFile = Annotated[
    Path | None, typer.Option(help="While this file exists the job is not started (again).")
]
StoreOption = Annotated[
    str | None,
    typer.Option("--store", help="The job's store: free-space preflight, DONE generation check."),
]
MinFreeBytes = Annotated[
    str | None,
    typer.Option(help="Do not start unless the store has this much free (10G, 500M)."),
]
LogFile = Annotated[
    Path | None, typer.Option(help="Append one JSON object per attempt to this file.")
]
DoneFile = Annotated[
    Path | None,
    typer.Option(help="Where the job writes its DONE record (then it must write one)."),
]
ConfigFile = Annotated[
    Path | None, typer.Option(help="The DONE record's config digest must be this file's.")
]
ExpectTokens = Annotated[
    int | None, typer.Option(help="The DONE record's token count must be this.")
]
CatalogFile = Annotated[
    Path | None,
    typer.Option(help="Record every attempt in this catalog (default: the per-user one)."),
]
NoCatalog = Annotated[bool, typer.Option("--no-catalog", help="Record attempts nowhere.")]
HangTimeout = Annotated[
    float | None,
    typer.Option(
        help="Stop and restart the job (a 'hang' attempt, within --max-restarts) when no "
        "rank reports progress (save, should_save, heartbeat) for this many seconds; "
        "with --hang-factor, the least it waits. Not watched before the first report.",
    ),
]
HangFactor = Annotated[
    float | None,
    typer.Option(
        help="Hang limit: K x the median interval between progress reports seen so far, "
        "never less than --hang-timeout (default 120 s).",
    ),
]
MemoryPath = Annotated[
    Path | None,
    typer.Option(
        "--memory-path",
        help="The job's memory tier on this node: each attempt's record says the newest "
        "step it holds (what a restart recovers from memory).",
    ),
]


def supervise(
    command: Command = None,
    max_restarts: MaxRestarts = 2,
    backoff: Backoff = "10,20,40",
    max_preemptions: MaxPreemptions = 100,
    grace_seconds: GraceSeconds = 30.0,
    stop_file: StopFile = None,
    store: StoreOption = None,
    min_free_bytes: MinFreeBytes = None,
    log: LogFile = None,
    done_file: DoneFile = None,
    config: ConfigFile = None,
    expect_tokens: ExpectTokens = None,
    catalog: CatalogFile = None,
    no_catalog: NoCatalog = False,
    memory_path: MemoryPath = None,
    hang_timeout: HangTimeout = None,
    hang_factor: HangFactor = None,
    s3_endpoint_url: S3EndpointUrl = None,
) -> int:
    """Run CMD; restart it after a failure (bounded, with backoff); check its DONE record.

    Attempts: at most 1 + --max-restarts (default 2 restarts: 3 attempts). Exit 75
    (preempted) restarts at once without using the budget; 78 (permanent) stops at once.

    Exit status: 0 success (DONE record verified when there is one); the
    job's last code when it failed permanently, was stopped by --stop-file,
    or failed too often (128+N when signal N killed it); 130/143 when the
    supervisor got SIGINT/SIGTERM; 65 DONE record missing or wrong; 74 not
    enough free space; 75 too many preemptions; 126/127 CMD not executable
    or not found; 2 usage error.

    No --json: what it prints is the job's own output and one line per attempt on
    stderr; --log FILE appends one JSON object per attempt for programs to read.
    """
    policy = Policy(
        max_restarts=max_restarts,
        backoff_s=parse_backoff(backoff),
        max_preemptions=max_preemptions,
        grace_s=grace_seconds,
    )
    if min_free_bytes is not None and store is None:
        raise UsageError("--min-free-bytes needs --store: the store whose free space to check")
    hang = None
    if hang_timeout is not None or hang_factor is not None:
        hang = HangPolicy(timeout_s=hang_timeout, factor=hang_factor)
    supervisor = Supervisor(
        list(command or []),
        policy,
        stop_file=stop_file,
        log_path=log,
        memory_path=memory_path,
        hang=hang,
    )
    if not no_catalog:  # the catalog shows every attempt beside the job's own saves
        path = catalog or default_catalog_path(default_ledger_path())
        supervisor.record = attempt_recorder(path, supervisor.emit)
    if store is not None and min_free_bytes is not None:
        _check_free_space(supervisor, store, min_free_bytes)
    with _done_path(done_file) as path, _progress_root(hang) as progress:
        supervisor.progress_root = progress
        supervisor.done = DoneExpectation(
            path=path,
            required=done_file is not None or config is not None or expect_tokens is not None,
            config_digest=file_digest(config) if config is not None else None,
            expect_tokens=expect_tokens,
            store=_store(store, s3_endpoint_url),
        )
        return supervisor.run()


def _check_free_space(supervisor: Supervisor, store: str, min_free_bytes: str) -> None:
    """Check the store's free space before every start (a local store only)."""
    local = local_store_path(store)
    if local is None:
        supervisor.emit(f"free-space preflight skipped: {store} is not a local store")
    else:
        supervisor.preflight = free_space_preflight(local, parse_size(min_free_bytes))


def _store(location: str | None, s3_endpoint_url: str | None) -> Store | None:
    """The store the DONE check reads. It may not exist yet (the job creates it), so
    it is not required to: a missing store lists no generation, which the check says."""
    if location is None:
        return None
    s3 = S3Options.from_keywords(endpoint_url=s3_endpoint_url)
    return open_store(location, s3=s3)
