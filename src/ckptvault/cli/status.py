"""``ckptvault status STORE``: is this store's checkpointing healthy?

Reads the store's listing and the catalog (:mod:`ckptvault.observe.health`): the
last good checkpoint's age, recent save latency, the failure rate, storage use, the
replication lag and the newest validation, with a warning for every alert threshold
crossed. ``--json`` prints the report as one object; ``--prometheus`` prints the
Prometheus text format (for node_exporter's textfile collector, say).

``--done-file PATH`` (the DONE record the job wrote, ``supervise --done-file``): when
the record matches the store, the run is reported finished (the ``finished`` object in
``--json``) and the age of its last checkpoint is no warning; a missing record or
one that does not match the store is an error.

Exit status: 0 healthy (or finished), 1 when there is at least one warning, 2 for a
usage error, an unreadable store or catalog, or a DONE record that does not match.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    CatalogLedgerOption,
    CatalogPathOption,
    S3EndpointUrl,
    catalog_file,
    err,
    human_bytes,
    open_store,
    out,
    print_json,
    safe_markup,
)
from ckptvault.errors import IntegrityError, UsageError
from ckptvault.observe.health import Finished, HealthReport, check_health
from ckptvault.observe.prometheus import import_prometheus
from ckptvault.storage.base import Store


def status(
    directory: Annotated[str, typer.Argument(help=STORE_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
    prometheus: Annotated[
        bool, typer.Option("--prometheus", help="Print the Prometheus text format.")
    ] = False,
    ledger: CatalogLedgerOption = None,
    catalog_path: CatalogPathOption = None,
    cadence_seconds: Annotated[
        float | None,
        typer.Option(
            "--cadence-seconds",
            min=0.001,
            help="The intended seconds between checkpoints (default: the median interval "
            "between recent successful saves).",
        ),
    ] = None,
    memory_path: Annotated[
        str | None,
        typer.Option(
            "--memory-path",
            help="The run's memory tier on this node, if not its default directory "
            "(/dev/shm/ckptvault-<uid>/<run id>/<node>).",
        ),
    ] = None,
    done_file: Annotated[
        Path | None,
        typer.Option(
            "--done-file",
            help="The run's DONE record (supervise --done-file): when it matches the store, "
            "the run is reported finished and the age of its last checkpoint is no warning.",
        ),
    ] = None,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Show the store's health: last good checkpoint age, save latency, failure rate,
    storage use, replication lag, this node's memory tier of the run; warn at every
    alert threshold (exit status 1)."""
    if as_json and prometheus:
        raise UsageError("give --json or --prometheus, not both")
    path = catalog_file(ledger, catalog_path, required=False)
    store = open_store(directory, s3_endpoint_url)
    finished = _finished(done_file, store) if done_file is not None else None
    report = check_health(store, path, cadence_seconds, finished=finished)
    _memory_tier(report, memory_path)
    if as_json:
        print_json(report.to_json())
    elif prometheus:
        sys.stdout.write(exposition(report).decode("utf-8"))
        sys.stdout.flush()
    else:
        _print(report)
    if report.warnings:
        raise typer.Exit(1)


def _finished(done_file: Path, store: Store) -> Finished:
    """The finished run the DONE record at ``done_file`` states, checked against the
    store (the generation it names is listed there, with the manifest digest it
    records). A record that is missing, malformed or does not match is an error (exit
    2): status must not call a run finished on the word of a stale record."""
    from ckptvault.ops.done import check_done_record, read_done_record

    try:
        record = read_done_record(done_file)
    except FileNotFoundError:
        raise UsageError(
            f"--done-file {done_file}: no DONE record there (the job writes it when it "
            "finishes); leave the option out for a run still training"
        ) from None
    problems = check_done_record(record, store=store)
    if problems:
        raise IntegrityError(
            f"--done-file {done_file} does not match store {store.location}: " + "; ".join(problems)
        )
    return Finished(record.step, record.generation_id, record.written_at, str(done_file))


def _memory_tier(report: HealthReport, memory_path: str | None) -> None:
    """The newest generation in this node's memory tier of the run (the default
    directory of the run the catalog names, or ``memory_path``): step and age."""

    from ckptvault.format.layout import generation_id_time
    from ckptvault.memory.tier import default_directory, existing_directory
    from ckptvault.storage import open_store as open_tier

    if memory_path is not None:
        where: Path | None = Path(memory_path)
    elif report.run_id is not None:
        where = default_directory(report.run_id)
    else:
        return
    found = existing_directory(where) if where is not None else None
    if found is None:
        return
    report.memory_tier = str(found)
    refs = open_tier(str(found)).list_generations()
    if refs:
        newest = max(refs, key=lambda ref: ref.name)
        created = generation_id_time(newest.generation_id).timestamp()
        report.memory_step = newest.step
        report.memory_age_s = max(0.0, report.checked_at - created)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{_age(seconds)} ago"


def _last_good(report: HealthReport) -> str:
    if report.last_good_step is None:
        return "none"
    return f"step {report.last_good_step}, {_ago(report.last_good_age_s)}"


def _marked(report: HealthReport) -> str:
    """The space retention marked but has not freed yet (its delete delay runs)."""
    if not report.marked_generations:
        return "none"
    return (
        f"{human_bytes(report.marked_bytes)} in {report.marked_generations} generation(s), "
        "freed when their delete delay passes (ls --all shows them; gc --undelete STEP "
        "brings one back)"
    )


def _print(report: HealthReport) -> None:
    rate = report.success_rate
    fs = report.filesystem
    lines = [
        ("store", report.store),
        ("catalog", report.catalog or "none (only the store's listing was read)"),
        ("generations", str(report.generations)),
        ("last good", _last_good(report)),
        ("last validated", _ago(report.last_validated_age_s)),
        ("cadence", f"{_age(report.cadence_s)} ({report.cadence_source or 'unknown'})"),
        (
            "save total p50/p99",
            f"{_age(report.save_total_s.p50)} / {_age(report.save_total_s.p99)}",
        ),
        (
            "save stall p50/p99",
            f"{_age(report.save_stall_s.p50)} / {_age(report.save_stall_s.p99)}",
        ),
        (
            "save success",
            "-" if rate is None else f"{rate:.1%} of the last {report.recent_saves}",
        ),
        ("replication lag", _age(report.replication_lag_s)),
    ]
    if report.finished is not None:
        done = report.finished
        lines.append(
            (
                "finished",
                f"step {done.step} ({done.generation_id}), DONE record {done.record} "
                f"written {done.written_at or 'at an unknown time'}",
            )
        )
    if report.memory_tier is not None:
        memory = "none" if report.memory_step is None else f"step {report.memory_step}, "
        memory += "" if report.memory_step is None else _ago(report.memory_age_s)
        lines.append(("memory (this node)", memory))
    lines += [(f"storage {tier}", human_bytes(n)) for tier, n in report.storage_bytes.items()]
    lines.append(("marked for deletion", _marked(report)))
    if fs is not None:
        lines.append(
            ("filesystem used", f"{fs.used_fraction:.1%} of {human_bytes(fs.total_bytes)}")
        )
    for label, value in lines:
        out.print(f"{label:<20} {safe_markup(value)}")
    for warning in report.warnings:
        err.print(f"[yellow]warning[/] {warning.alert}: {safe_markup(warning.message)}")
    if report.healthy:
        out.print("[green]finished[/]" if report.finished is not None else "[green]healthy[/]")


# One row per sample: name, help, value (None: left out), extra labels.
_Row = tuple[str, str, float | None, dict[str, str]]


def _rows(report: HealthReport) -> list[_Row]:
    fs, tiers = report.filesystem, report.storage_bytes
    replicas = [n for tier, n in tiers.items() if tier != report.store]
    rows: list[_Row] = [
        ("ckptvault_last_good_checkpoint_age_seconds", "Age of the newest generation.",
         report.last_good_age_s, {}),
        ("ckptvault_last_validated_checkpoint_age_seconds", "Age of the newest validation.",
         report.last_validated_age_s, {}),
        ("ckptvault_checkpoint_interval_seconds", "The cadence status judged the age by.",
         report.cadence_s, {}),
        ("ckptvault_replication_lag_seconds", "How long the replica has been behind.",
         report.replication_lag_s, {}),
        ("ckptvault_memory_last_save_age_seconds", "Age of this node's newest memory save.",
         report.memory_age_s, {}),
        ("ckptvault_generations", "Generations restore would consider.",
         report.generations, {"tier": "local"}),
        ("ckptvault_recent_save_success_ratio", "Successful share of the recent saves.",
         report.success_rate, {}),
        ("ckptvault_storage_used_bytes", "Bytes of generations per tier.",
         tiers.get(report.store), {"tier": "local"}),
        ("ckptvault_storage_used_bytes", "Bytes of generations per tier.",
         sum(replicas) if replicas else None, {"tier": "replica"}),
        ("ckptvault_storage_marked_bytes", "Bytes of generations marked for deletion.",
         report.marked_bytes, {"tier": "local"}),
        ("ckptvault_storage_filesystem_used_ratio", "Used fraction of the filesystem.",
         None if fs is None else fs.used_fraction, {"tier": "local"}),
        ("ckptvault_status_warnings", "Alert thresholds crossed.", len(report.warnings), {}),
    ]  # fmt: skip
    for kind, latency in (("duration", report.save_total_s), ("blocking", report.save_stall_s)):
        for quantile, value in (("0.5", latency.p50), ("0.99", latency.p99)):
            name = f"ckptvault_recent_save_{kind}_seconds"
            rows.append(
                (name, f"Recent saves' {kind}, percentiles.", value, {"quantile": quantile})
            )
    return rows


def exposition(report: HealthReport) -> bytes:
    """The report in the Prometheus text format: the manager's gauge names where the
    meaning is the same (``ckptvault_last_good_checkpoint_age_seconds``, ...), and
    ``ckptvault_recent_save_*_seconds{quantile=...}`` for the percentiles."""
    pc = import_prometheus("ckptvault status --prometheus")
    registry = pc.CollectorRegistry()
    gauges: dict[str, Any] = {}
    for name, doc, value, labels in _rows(report):
        if value is None:
            continue
        if name not in gauges:
            gauges[name] = pc.Gauge(name, doc, ["run_id", *labels], registry=registry)
        gauges[name].labels(report.run_id or "", *labels.values()).set(value)
    return bytes(pc.generate_latest(registry))
