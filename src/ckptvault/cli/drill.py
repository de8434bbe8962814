"""``ckptvault drill STORE | --synthetic [--json] [--only NAME,...]``: recovery drills.

``drill STORE`` copies the store's newest generations (read only; an ``s3://`` store
into a local temporary store) and runs the drills on that copy; the live store is
never written. ``drill --synthetic`` drills a small signed, encrypted run it builds.
The report is a table (progress on stderr); ``--json`` prints a list with one
object per drill: ``name``, ``passed`` (true, false, or null when it could not run
here, with ``skipped`` saying why), ``expected``, ``observed`` and its timings in
seconds under keys ending in ``_s``. Exit status 0 when no drill failed, 1 when
any did, 2 for a usage or store error.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    KeystoreOption,
    S3EndpointUrl,
    out,
    print_json,
    print_table,
    safe_markup,
)
from ckptvault.cli._progress import progress_bar
from ckptvault.errors import UsageError
from ckptvault.progress import Meter

if TYPE_CHECKING:
    from ckptvault.ops.drills import DrillContext, DrillResult

TIMING_COLUMNS = ("discovery", "verification", "read", "apply", "recovery")


def drill(
    store: Annotated[str | None, typer.Argument(help=STORE_HELP)] = None,
    synthetic: Annotated[
        bool, typer.Option("--synthetic", help="Drill a small run built for the purpose.")
    ] = False,
    only: Annotated[
        str | None, typer.Option("--only", help="Run only these drills (comma-separated names).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list on stdout.")] = False,
    generations: Annotated[
        int, typer.Option(help="How many of the newest generations to copy.")
    ] = 3,
    keystore: KeystoreOption = None,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Run the recovery drills on a copy of STORE (or on --synthetic) and report."""
    from ckptvault.ops.drills import choose_drills, run_drills

    if (store is None) == (not synthetic):
        raise UsageError("give a STORE to drill a copy of, or --synthetic (not both)")
    chosen = choose_drills([n.strip() for n in only.split(",") if n.strip()] if only else None)
    with (
        tempfile.TemporaryDirectory(prefix="ckptvault-drill-") as scratch,
        progress_bar("preparing", "items", as_json=as_json) as bar,
    ):
        finished = Meter(bar, len(chosen))  # drills run, of how many
        context = _context(Path(scratch), store, keystore, generations, s3_endpoint_url)
        with _expected_warnings_quiet():
            results = run_drills(
                context,
                chosen,
                on_start=lambda d: bar.describe(f"drill {safe_markup(d.name)}"),
                on_done=lambda _r: finished(1),
            )
    if as_json:
        print_json([result.to_json() for result in results])
    else:
        _print_table(results, context.source)
    if any(result.passed is False for result in results):
        raise typer.Exit(1)


def _context(
    scratch: Path,
    store: str | None,
    keystore: str | None,
    generations: int,
    s3_endpoint_url: str | None,
) -> DrillContext:
    from ckptvault.ops.drills import context_from_store, synthetic_context

    if store is None:
        if keystore is not None:
            raise UsageError("--keystore is for drilling a STORE; --synthetic makes its own keys")
        return synthetic_context(scratch)
    return context_from_store(store, scratch, keystore, generations, s3_endpoint_url)


@contextlib.contextmanager
def _expected_warnings_quiet() -> Iterator[None]:
    """Drills make restores skip generations on purpose: the warnings each skip logs
    are what the drill checks, not news for whoever reads the report."""
    logger = logging.getLogger("ckptvault")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _print_table(results: list[DrillResult], source: str) -> None:
    verdicts = {True: "pass", False: "FAIL", None: "skipped"}
    columns = ["drill", "result", *(f"{name} s" for name in TIMING_COLUMNS), "observed (expected)"]
    rows = []
    for result in results:
        timings = [
            f"{result.timings[name]:.3f}" if name in result.timings else "-"
            for name in TIMING_COLUMNS
        ]
        said = result.skipped if result.skipped is not None else result.observed
        rows.append(
            [
                result.name,
                verdicts[result.passed],
                *timings,
                f"{said} (expected: {result.expected})",
            ]
        )
    print_table(
        columns,
        rows,
        right=columns[2:-1],
        title=f"Recovery drills on a copy of {source}",
        styles={"result": {"pass": "green", "FAIL": "red", "skipped": "yellow"}},
    )
    failed = [r.name for r in results if r.passed is False]
    skipped = [r.name for r in results if r.passed is None]
    summary = f"{len(results) - len(failed) - len(skipped)} passed"
    summary += f", {len(failed)} failed ({', '.join(failed)})" if failed else ", 0 failed"
    summary += f", {len(skipped)} skipped" if skipped else ""
    out.print(summary, markup=False)
