"""``ckptvault gc STORE``: retention and garbage collection from the command line.

Without ``--dry-run`` it takes the store's writer lock (so it never races a
trainer), verifies the newest generation (every byte) before anything may go, plans
retention with the rules given (``--keep-last`` ... as in ``cv.Retention``; with no
rule it only finishes what was marked before), applies the plan — marking first,
deleting a marked generation once ``--delete-delay`` has passed — and removes
staging leftovers older than ``--stale-after``. Every generation is printed with
what happens to it and why. ``--undelete STEP`` removes the marks of that step's
generations (and pins them, so that the next pass does not mark them again);
``--pin``/``--unpin STEP`` keep a step from retention or give it back. Those three
only touch records and need no lock. A generation under Object Lock is kept
("locked until DATE"); versions of deleted objects a versioned bucket may not
delete yet are listed as retained copies (``retained_copies`` in ``--json``).

The manager records its retention policy in the store (:mod:`ckptvault.retention.recorded`);
gc applies it besides the rules given (a generation either keeps is kept, the longer
delete delay wins): ``gc --keep-last 3`` no longer marks the trainer's ``keep_best``
winner. A recorded policy only ever keeps more, so a record forged by whoever can
write the store costs space, never a generation. With no rule options gc applies it
alone only when given no trust options (``--trusted-key``, ``--keystore``,
``--ledger``): the record is unsigned store data, and where gc accepts only what those
options authenticate it must not decide alone what is deleted; gc then finishes
earlier marks and says which options state the recorded rules. ``--replace-policy`` replaces it with the rules given: it first shows what
they alone would do (a dry run), then asks, or needs ``--yes`` when no one can be
asked (exit 2, nothing changed); with ``--dry-run`` it only shows.

gc trusts exactly what restore trusts: a generation takes a rule's place only if it
passes restore's checks under the trust options given (``--trusted-key``,
``--keystore``, ``--ledger``, as ``verify`` takes them). On a store whose generations
those options cannot authenticate (an encrypted generation without ``--keystore``, a
signed one without ``--trusted-key``) it refuses with one line naming the option and
marks nothing: a forgery there could take a rule's place. Without ``--run-id`` the run
is the one whose generations those options accept; a store where they accept
generations of several runs is refused (``--run-id`` says whose): a genuine generation
of another run, copied in, must not take this run's places.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    KeystoreOption,
    S3EndpointUrl,
    err,
    open_store,
    out,
    print_json,
    safe_text,
)
from ckptvault.cli._gc_policy import GcPolicy, applicable, confirm_replacement
from ckptvault.cli._progress import progress_bar
from ckptvault.errors import CheckpointError, StoreLockedError, UsageError
from ckptvault.events import EventBus, Unmarked
from ckptvault.format.layout import format_timestamp
from ckptvault.observe.catalog import validated_generations
from ckptvault.observe.catalog_recorder import resolve_catalog_path
from ckptvault.retention import marks
from ckptvault.retention.apply import AppliedPlan
from ckptvault.retention.collector import GarbageCollector
from ckptvault.retention.plan import Decision, RetentionPlan
from ckptvault.retention.policy import Retention, format_seconds
from ckptvault.retention.recorded import read_policy, record_policy
from ckptvault.storage.base import Store
from ckptvault.trust.checks import VerificationReport, check_trusted
from ckptvault.trust.context import TrustContext
from ckptvault.trust.ledger import RestoreFloor
from ckptvault.trust.problems import GenerationRejected

_DURATION_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhdw]?)\Z")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_RECORD_OPTIONS = ("--undelete", "--pin", "--unpin")

logger = logging.getLogger("ckptvault")


def parse_duration(text: str, option: str) -> float:
    """``90s``, ``30m``, ``24h``, ``7d``, ``2w`` or plain seconds; ``0s`` is allowed."""
    match = _DURATION_RE.match(text.strip().lower())
    if match is None:
        raise UsageError(f"{option} {text!r} is not a duration like 90s, 30m, 24h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


# The options of `ckptvault gc` whose declarations take more than a line, named here so
# that the command's signature reads one option per line.
_DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")]
_AsJson = Annotated[bool, typer.Option("--json", help="Print a JSON report on stdout.")]
_StaleAfter = Annotated[
    str, typer.Option(help="Remove staging leftovers older than this (e.g. 24h, 0s).")
]
_Undelete = Annotated[
    int | None, typer.Option(help="Remove the deletion marks of this step (and pin it).")
]
_KeepWithin = Annotated[str | None, typer.Option(help="Keep everything newer than this (e.g. 2d).")]
_DeleteDelay = Annotated[
    str | None,
    typer.Option(
        help="Time between marking and deleting (e.g. 1d, 0s; default: 0s for --keep-last "
        "alone, else 1d; never shorter than the recorded policy's)."
    ),
]
_ReplacePolicy = Annotated[
    bool,
    typer.Option(
        "--replace-policy",
        help="Replace the retention policy recorded in the store (the trainer's) with the "
        "rules given: shows what they would delete first, then asks (or --yes).",
    ),
]
_Yes = Annotated[bool, typer.Option("--yes", help="With --replace-policy: do not ask.")]
_RunId = Annotated[
    str | None,
    typer.Option(help="Require this run id (default: the one run the store's generations are)."),
]
_TrustedKeys = Annotated[
    list[Path] | None,
    typer.Option("--trusted-key", help="Require a signature by this public key (repeatable)."),
]
_LedgerPath = Annotated[
    Path | None, typer.Option(help="The rollback ledger (protects the floor's generation).")
]
_AuditLogPath = Annotated[
    Path | None, typer.Option(help="Record marks and deletions in this audit log.")
]


def gc(
    # One parameter per command-line option: the declarations are long, the body is steps.
    directory: Annotated[str, typer.Argument(help=STORE_HELP)],
    dry_run: _DryRun = False,
    as_json: _AsJson = False,
    stale_after: _StaleAfter = "24h",
    undelete: _Undelete = None,
    pin: Annotated[int | None, typer.Option(help="Keep this step from retention.")] = None,
    unpin: Annotated[int | None, typer.Option(help="Give this step back to retention.")] = None,
    keep_last: Annotated[int | None, typer.Option(help="Keep the N newest.")] = None,
    keep_every: Annotated[int | None, typer.Option(help="Keep steps that are multiples.")] = None,
    keep_best: Annotated[int | None, typer.Option(help="Keep the K best by --metric.")] = None,
    metric: Annotated[str | None, typer.Option(help="The metric --keep-best ranks by.")] = None,
    mode: Annotated[str, typer.Option(help="min or max: which --metric value is best.")] = "min",
    keep_within: _KeepWithin = None,
    keep_hourly: Annotated[int | None, typer.Option(help="Newest of each of H hours.")] = None,
    keep_daily: Annotated[int | None, typer.Option(help="Newest of each of D days.")] = None,
    keep_weekly: Annotated[int | None, typer.Option(help="Newest of each of W ISO weeks.")] = None,
    delete_delay: _DeleteDelay = None,
    replace_policy: _ReplacePolicy = False,
    yes: _Yes = False,
    run_id: _RunId = None,
    trusted_key: _TrustedKeys = None,
    keystore: KeystoreOption = None,
    ledger: _LedgerPath = None,
    audit_log: _AuditLogPath = None,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Apply retention: mark, then delete old generations; remove staging leftovers."""
    store = open_store(directory, s3_endpoint_url)
    stale_seconds = parse_duration(stale_after, "--stale-after")
    delay = parse_duration(delete_delay, "--delete-delay") if delete_delay is not None else None
    trust = TrustContext.configure(
        trusted_keys=trusted_key, keystore=keystore, ledger=ledger, audit_log=audit_log
    )
    trust.check_outside(store)
    events = EventBus(trust.subscribers())
    within = parse_duration(keep_within, "--keep-within") if keep_within else None
    rule_options = dict(
        keep_last=keep_last,
        keep_every=keep_every,
        keep_best=keep_best,
        metric=metric,
        keep_within=within,
        keep_hourly=keep_hourly,
        keep_daily=keep_daily,
        keep_weekly=keep_weekly,
    )
    record_change = _record_change(undelete, pin, unpin, rule_options, dry_run)
    if record_change is not None:
        if replace_policy:
            raise UsageError("--replace-policy records rules: not with --undelete/--pin/--unpin")
        option, step = record_change
        _change_records(store, option, step, run_id, events, as_json)
        return
    given = _retention(rule_options, mode, delay)
    run = _the_run(store, trust, run_id)
    policy = _pass_policy(store, given, run, trust, delay, replace_policy, yes or dry_run, as_json)
    with _writer_lock(store, held=not dry_run):
        if replace_policy and not dry_run:
            assert given is not None and run is not None  # confirm_replacement checked both
            record_policy(store, run, given, datetime.now(timezone.utc))
        report = _collect(store, policy, stale_seconds, run, trust, events, dry_run, as_json)
    _finish(report, as_json)


def _pass_policy(
    store: Store,
    given: Retention | None,
    run: str | None,
    trust: TrustContext,
    delay: float | None,
    replace: bool,
    confirmed: bool,
    as_json: bool,
) -> GcPolicy:
    """What this pass applies: with --replace-policy the rules given alone (after the
    preview and the question, unless ``confirmed``), else the rules given and the
    recorded policy where it may count."""
    if not replace:
        recorded = read_policy(store, run) if run is not None else None
        return GcPolicy.of(given, applicable(recorded, given, trust), delay)

    def preview() -> None:  # what the new rules alone would do
        alone = GcPolicy.of(given, None, None)
        report = _collect(store, alone, 0.0, run, trust, EventBus(()), True, as_json)
        _print_preview(report, as_json)

    confirm_replacement(store, given, run, confirmed, preview)
    return GcPolicy.of(given, None, delay)


def _print_preview(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(report)
    else:
        _print_report(report)


def _record_change(
    undelete: int | None,
    pin: int | None,
    unpin: int | None,
    rule_options: dict[str, Any],
    dry_run: bool,
) -> tuple[str, int] | None:
    """The one record change asked for (option, step), or None to collect garbage."""
    records = dict(zip(_RECORD_OPTIONS, (undelete, pin, unpin), strict=True))
    asked = [option for option, step in records.items() if step is not None]
    if not asked:
        return None
    given = [name for name, value in rule_options.items() if value is not None]
    if len(asked) > 1 or given or dry_run:
        raise UsageError(
            f"{', '.join(asked)}: give one of --undelete, --pin, --unpin alone (no rule "
            "options, no --dry-run); run gc again afterwards to collect garbage"
        )
    step = records[asked[0]]
    assert step is not None  # asked holds only the options given
    return asked[0], step


def _retention(rule_options: dict[str, Any], mode: str, delay: float | None) -> Retention | None:
    """The policy the rule options give (its default delay when --delete-delay is not
    given); None without any."""
    if all(value is None for value in rule_options.values()):
        return None
    if delay is None:
        return Retention(**rule_options, mode=mode)  # the default delay for these rules
    return Retention(**rule_options, mode=mode, delete_delay=delay)


@contextlib.contextmanager
def _writer_lock(store: Store, held: bool) -> Iterator[None]:
    """The store's writer lock around a pass that changes it (a dry run takes none)."""
    if not held:
        yield
        return
    _lock(store)
    try:
        yield
    finally:
        store.release_writer()


def _lock(store: Store) -> None:
    try:
        store.acquire_writer()
    except StoreLockedError as exc:
        holder = re.search(r"\((pid [^)]*|holder unknown)\)", str(exc))
        raise StoreLockedError(
            f"store {store.location} is being written by a live process "
            f"({holder.group(1) if holder else 'holder unknown'}); gc deletes only while no "
            "trainer writes the store. Run `ckptvault gc` when the trainer is idle, or let the "
            "trainer apply retention itself: CheckpointManager(..., retention=cv.Retention(...))"
        ) from None


def _collect(
    store: Store,
    policy: GcPolicy,
    stale_seconds: float,
    run_id: str | None,
    trust: TrustContext,
    events: EventBus,
    dry_run: bool,
    as_json: bool,
) -> dict[str, Any]:
    """Verify, plan and (unless ``dry_run``) apply, with bars on a terminal."""
    now = datetime.now(timezone.utc)
    collector = GarbageCollector(
        [store],
        policy.rules,
        policy.delete_delay,
        policy=trust.policy(run_id, None),
        run_id=run_id,
        emit=events.emit,
    )
    collector.require_keys = True  # refuse what these options cannot authenticate
    with progress_bar("verifying the newest generation", as_json=as_json) as bar:
        newest = collector.verify_newest(now, bar)
    run = run_id or (newest.manifest.run_id if newest and newest.manifest else None)
    # The newest validated generation is never pruned (the catalog beside the ledger).
    catalog = resolve_catalog_path(None, trust.ledger.path if trust.ledger else None)
    collector.validated = lambda: validated_generations(catalog, run)
    # With a ledger, only the marks it recorded count (restore's rule for marks).
    collector.recorded_marks = lambda: trust.recorded_marks(run) if run is not None else None
    floor: RestoreFloor | None = trust.floor(run) if run is not None else None
    plan = collector.plan(now=now, floor=floor)
    applied = None
    if not dry_run:
        with progress_bar("applying retention", "items", as_json=as_json) as bar:
            applied = collector.apply(plan, bar)
    staging = None if dry_run else store.remove_stale_staging(older_than=stale_seconds)
    return _report(store, policy, stale_seconds, collector, plan, applied, staging)


def _the_run(store: Store, trust: TrustContext, run_id: str | None) -> str | None:
    """``--run-id``, or the one run whose generations pass restore's checks under these
    trust options (None when none does). Every generation is asked, not only the
    newest: a genuine generation of another run signed with the same key (or encrypted
    under the same key store) and copied in with higher steps would otherwise be taken
    for the run, take its rules' places and have the run's own generations deleted.
    UsageError, before anything is marked, when they name several runs."""
    if run_id is not None:
        return run_id
    policy = trust.policy(None, None)
    runs: dict[str, int] = {}  # run id -> a step of it
    for ref in store.list_generations():
        try:
            manifest = check_trusted(store, ref, policy).manifest
        except (GenerationRejected, CheckpointError, OSError):
            continue  # no rule counts it for any run
        runs.setdefault(manifest.run_id, ref.step)
    if len(runs) > 1:
        found = ", ".join(f"{run[:80]!r} (step {step})" for run, step in sorted(runs.items())[:5])
        raise UsageError(
            f"store {store.location} holds generations of several runs that pass restore's "
            f"checks: {found}; pass --run-id to say whose generations gc decides about. "
            "Nothing was marked or deleted"
        )
    return next(iter(runs), None)


def _report(
    store: Store,
    policy: GcPolicy,
    stale_seconds: float,
    collector: GarbageCollector,
    plan: RetentionPlan,
    applied: AppliedPlan | None,
    staging: list[str] | None,
) -> dict[str, Any]:
    def decision(d: Decision) -> dict[str, Any]:
        entry = d.to_json()
        entry["outcome"] = applied.outcome(d) if applied is not None else None
        return entry

    return {
        "store": store.location,
        "policy": policy.described,
        "dry_run": applied is None,
        **plan.to_json(),
        "decisions": [decision(d) for d in plan.decisions],
        "verified": [_verification(report) for report in collector.reports],
        "failed": [
            {"step": d.step, "generation_id": d.generation_id, "error": why}
            for d, why in (applied.failed if applied else [])
        ],
        "retained_copies": applied.retained_json() if applied is not None else [],
        "stale_after_seconds": stale_seconds,
        "staging_removed": staging,
    }


def _finish(report: dict[str, Any], as_json: bool) -> None:
    """Print the report; exit 1 when nothing verified (with generations to decide on)
    or a deletion failed."""
    if as_json:
        print_json(report)
    else:
        _print_report(report)
    if (report["newest_verified"] is None and report["decisions"]) or report["failed"]:
        raise typer.Exit(1)


def _verification(report: VerificationReport) -> dict[str, Any]:
    return {
        "step": report.ref.step,
        "generation_id": report.ref.generation_id,
        "ok": report.ok,
        "problems": [{"code": p.code, "file": p.file, "detail": p.detail} for p in report.problems],
    }


def _print_report(report: dict[str, Any]) -> None:
    dry = "  (dry run: nothing changed)" if report["dry_run"] else ""
    # Store-derived strings (names, mark reasons, errors): escaped for the terminal.
    out.print(safe_text(f"gc {report['store']}: {report['policy']}{dry}"), markup=False)
    for checked in report["verified"]:
        verdict = (
            "verifies"
            if checked["ok"]
            else "FAILS: " + ", ".join(p["code"] for p in checked["problems"])
        )
        out.print(
            safe_text(f"  verified step {checked['step']} ({checked['generation_id']}): {verdict}"),
            markup=False,
        )
    if report["blocked"]:
        out.print(safe_text(f"  nothing is marked or deleted: {report['blocked']}"), markup=False)
    for d in report["decisions"]:
        line = f"  step {d['step']:>8}  {d['generation_id']}  {d['action']:<7} {'; '.join(d['reasons'])}"
        if d["marked_at"] and d["action"] != "keep":
            line += f"; marked {d['marked_at']}"
            if d["delete_after"]:
                line += f", deleted after {d['delete_after']}"
        if d["outcome"]:
            line += f"  -> {d['outcome']}"
        out.print(safe_text(line), markup=False)
    if not report["decisions"]:
        out.print("  no generations")
    for copy in report["retained_copies"]:  # versions the store may not delete yet
        line = f"  retained copy of step {copy['step']}: {copy['location']} (version {copy['version_id']}): {copy['reason']}"
        out.print(safe_text(line), markup=False)
    removed = report["staging_removed"]
    if removed is not None:
        older = format_seconds(report["stale_after_seconds"])
        listed = ": " + ", ".join(removed) if removed else ""
        out.print(
            safe_text(f"  staging: removed {len(removed)} leftover(s) older than {older}{listed}"),
            markup=False,
        )
    for failure in report["failed"]:
        err.print(
            safe_text(
                f"ckptvault: step {failure['step']} ({failure['generation_id']}): "
                f"{failure['error']}"
            ),
            markup=False,
        )


def _change_records(
    store: Store, option: str, step: int, run_id: str | None, events: EventBus, as_json: bool
) -> None:
    now = datetime.now(timezone.utc)
    if option == "--undelete":
        refs = marks.undelete(store, step, now)
        for ref in refs:
            events.emit(
                Unmarked(run_id, store.location, ref.step, ref.generation_id, "undeleted by gc")
            )
        done = "undeleted and pinned" if refs else "nothing marked to undelete"
    elif option == "--pin":
        marks.pin(store, step, now)  # every generation of the step
        refs = marks.generations_of(store, step)
        done = "pinned"
    else:
        refs = marks.unpin(store, step)
        done = "unpinned" if refs else "nothing pinned"
    if as_json:
        print_json(
            {
                "store": store.location,
                "action": option.lstrip("-"),
                "step": step,
                "generations": [ref.generation_id for ref in refs],
                "at": format_timestamp(now),
            }
        )
        return
    names = ", ".join(ref.generation_id for ref in refs)
    out.print(safe_text(f"step {step}: {done}{': ' + names if names else ''}"), markup=False)
