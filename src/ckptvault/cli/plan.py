"""``ckptvault plan``: how often to checkpoint, how big, how fast, how much storage.

The formulas live in :mod:`ckptvault.planning.cadence` (intervals, overhead, lost
work) and :mod:`ckptvault.planning.sizing` (size, bandwidth, storage); this module
gathers the inputs — from options, or measured: the size of a store's newest
generation and the save cost from the catalog of its recent saves (``--from``) —
checks that they fit together, and prints the answers as a table, JSON or a plot.

Every option that cannot be used with the others given is an error that says what
is missing, rather than silently ignored: a planner that drops an input answers a
different question than the one asked.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from ckptvault.cli._common import S3EndpointUrl, open_store, print_json
from ckptvault.cli._plan_output import print_plan, write_overhead_plot
from ckptvault.errors import UsageError
from ckptvault.planning.cadence import (
    SECONDS_PER_HOUR,
    PlanInputs,
    job_mtbf_seconds,
    plan_cadence,
    require_non_negative,
    require_positive,
)
from ckptvault.planning.measured import measure_checkpoint
from ckptvault.planning.sizing import (
    RECIPES,
    bytes_per_param,
    checkpoint_bytes,
    parse_count,
    parse_keep,
)
from ckptvault.storage.base import Store

_MTBF_HINT = "give --mtbf-hours, or --nodes with --node-mtbf-years"
_SIZE_HINT = "give --params with --recipe or --bytes-per-param, or --from STORE"
_INTERVAL_HINT = (
    f"give --save-seconds (or --from STORE with a catalog of its saves) and {_MTBF_HINT}"
)
_CATALOG_SAVES = 50  # recent saves whose median stall is the save cost

SaveSeconds = Annotated[
    float | None,
    typer.Option("--save-seconds", help="Save cost C: seconds a save blocks training."),
]
FromStore = Annotated[
    str | None,
    typer.Option(
        "--from",
        help="Size from this store's newest generation; C from the catalog's recent saves.",
    ),
]
CatalogPath = Annotated[
    Path | None,
    typer.Option("--catalog", help="The catalog --from reads (default: beside the ledger)."),
]
MtbfHours = Annotated[
    float | None, typer.Option("--mtbf-hours", help="The job's mean time between failures M.")
]
Nodes = Annotated[
    int | None, typer.Option("--nodes", help="Nodes the job runs on (M = node MTBF / nodes).")
]
NodeMtbfYears = Annotated[
    float | None, typer.Option("--node-mtbf-years", help="Mean time between failures of one node.")
]
RestoreSeconds = Annotated[
    float | None, typer.Option("--restore-seconds", help="Restart R: failure to training again.")
]
StepSeconds = Annotated[
    float | None,
    typer.Option("--step-seconds", help="Seconds per training step (answers in steps)."),
]
Params = Annotated[
    str | None, typer.Option("--params", help="Parameter count: 70e9, 70B, 7.5B or 70000000000.")
]
BytesPerParam = Annotated[
    float | None, typer.Option("--bytes-per-param", help="Checkpoint bytes per parameter.")
]
Recipe = Annotated[
    str | None,
    typer.Option("--recipe", help=f"Bytes per parameter by name: {', '.join(RECIPES)}."),
]
StallSeconds = Annotated[
    float | None,
    typer.Option("--stall-seconds", help="Longest stall allowed: answers the bandwidth needed."),
]
Keep = Annotated[
    list[str] | None,
    typer.Option("--keep", help="Generations kept: 3, or per tier: --keep local=3 --keep s3=10."),
]
MaxInFlight = Annotated[
    int | None, typer.Option("--max-in-flight", help="Saves in flight at once (default 1).")
]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
PlotFile = Annotated[
    Path | None,
    typer.Option("--plot", help="Draw overhead against interval into FILE.png (needs matplotlib)."),
]


@dataclass(frozen=True)
class _Size:
    """The checkpoint size and where it came from."""

    bytes: int
    source: str
    params: int | None = None
    bytes_per_param: float | None = None
    recipe: str | None = None
    store: Store | None = None


def plan(
    save_seconds: SaveSeconds = None,
    from_store: FromStore = None,
    catalog: CatalogPath = None,
    mtbf_hours: MtbfHours = None,
    nodes: Nodes = None,
    node_mtbf_years: NodeMtbfYears = None,
    restore_seconds: RestoreSeconds = None,
    step_seconds: StepSeconds = None,
    params: Params = None,
    bytes_per_param_: BytesPerParam = None,
    recipe: Recipe = None,
    stall_seconds: StallSeconds = None,
    keep: Keep = None,
    max_in_flight: MaxInFlight = None,
    as_json: AsJson = False,
    plot: PlotFile = None,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Plan the checkpoint cadence (Young, Daly), size, write bandwidth and storage."""
    if catalog is not None and from_store is None:
        raise UsageError("--catalog is read for --from STORE; give --from too")
    mtbf, mtbf_source = _mtbf(mtbf_hours, nodes, node_mtbf_years)
    size = _size(from_store, params, recipe, bytes_per_param_, s3_endpoint_url)
    cost, cost_source = _save_cost(save_seconds, mtbf, size, catalog)
    inputs = PlanInputs(
        save_seconds=cost,
        mtbf_seconds=mtbf,
        restore_seconds=0.0 if restore_seconds is None else restore_seconds,
        step_seconds=step_seconds,
        checkpoint_bytes=None if size is None else size.bytes,
        stall_seconds=stall_seconds,
        keep=parse_keep(keep or []),
        max_in_flight=1 if max_in_flight is None else max_in_flight,
    )
    _check_combinations(inputs, restore_seconds, max_in_flight, plot)
    result = plan_cadence(inputs)
    if plot is not None:
        write_overhead_plot(result, plot)
    sources = {"save_seconds": cost_source, "mtbf_s": mtbf_source}
    if as_json:
        print_json(_json(result.to_json(), size, sources, plot))
        return
    print_plan(result, size_note=_size_note(size), sources=sources, plot=plot)


def _mtbf(
    hours: float | None, nodes: int | None, node_years: float | None
) -> tuple[float | None, str | None]:
    """M in seconds and how it was given, from one of the two ways to give it."""
    if hours is not None and (nodes is not None or node_years is not None):
        raise UsageError("give --mtbf-hours or --nodes with --node-mtbf-years, not both")
    if hours is not None:
        return require_positive("--mtbf-hours", hours) * SECONDS_PER_HOUR, "--mtbf-hours"
    if nodes is None and node_years is None:
        return None, None
    if nodes is None or node_years is None:
        raise UsageError("--nodes and --node-mtbf-years go together: the job MTBF is their ratio")
    return job_mtbf_seconds(nodes, node_years), f"{nodes} nodes × {node_years:g} years / node"


def _size(
    from_store: str | None,
    params: str | None,
    recipe: str | None,
    explicit: float | None,
    s3_endpoint_url: str | None,
) -> _Size | None:
    """The checkpoint size: measured in a store, or parameters × bytes per parameter."""
    per_param = bytes_per_param(recipe, explicit)
    if from_store is not None:
        if params is not None or per_param is not None:
            raise UsageError(
                "--from STORE measures the checkpoint size; leave out --params, --recipe "
                "and --bytes-per-param (or leave out --from to size it from parameters)"
            )
        store = open_store(from_store, s3_endpoint_url)
        # Not the listing's newest: a planted empty directory would size it at 0 bytes.
        newest = measure_checkpoint(store)
        return _Size(newest.bytes, f"store, step {newest.step}", store=store)
    if params is None:
        if per_param is not None:
            raise UsageError(
                "--recipe and --bytes-per-param size a checkpoint from --params; give --params too"
            )
        return None
    count = parse_count(params)
    if per_param is None:
        raise UsageError(f"--params needs --recipe ({', '.join(RECIPES)}) or --bytes-per-param")
    size = checkpoint_bytes(count, per_param)
    return _Size(size, "--params", params=count, bytes_per_param=per_param, recipe=recipe)


def _save_cost(
    save_seconds: float | None, mtbf: float | None, size: _Size | None, catalog: Path | None
) -> tuple[float | None, str | None]:
    """C in seconds and where it came from: ``--save-seconds``, else (with an MTBF to
    plan against and a store) the median stall of the catalog's recent saves."""
    if save_seconds is not None:
        if mtbf is None:
            raise UsageError(f"--save-seconds needs the MTBF to plan against: {_MTBF_HINT}")
        return require_positive("--save-seconds", save_seconds), "--save-seconds"
    if mtbf is None:
        return None, None
    if size is None or size.store is None:
        raise UsageError(f"the MTBF needs the save cost to plan against: {_INTERVAL_HINT}")
    stalls = _catalog_stalls(size.store, catalog)
    return statistics.median(stalls), f"catalog: median stall of {len(stalls)} saves"


def _catalog_stalls(store: Store, path: Path | None) -> list[float]:
    """The stalls of the store's recent successful saves, from the catalog; a
    :class:`UsageError` saying why not (and to give ``--save-seconds``) otherwise."""
    remedy = "give the save cost with --save-seconds"
    try:
        from ckptvault.observe import catalog as catalog_module
    except ImportError:
        raise UsageError(f"this ckptvault keeps no catalog of saves; {remedy}") from None
    if path is None:
        from ckptvault.trust.ledger import default_ledger_path

        path = catalog_module.default_catalog_path(default_ledger_path())
    if not path.is_file():
        # Never create a catalog by looking: an empty one would hide the typo.
        raise UsageError(f"no catalog at {path} (no save recorded there yet); {remedy}")
    with catalog_module.Catalog(path) as catalog:
        records = catalog.recent_saves(store=store.location, limit=_CATALOG_SAVES)
    stalls = [record.stall_seconds for record in records if record.ok and record.stall_seconds > 0]
    if not stalls:
        raise UsageError(
            f"the catalog {path} records no successful save into {store.location}; {remedy}"
        )
    return stalls


def _check_combinations(
    inputs: PlanInputs, restore_seconds: float | None, max_in_flight: int | None, plot: Path | None
) -> None:
    """Refuse options that the other inputs leave unused, and a plan of nothing."""
    intervals = inputs.save_seconds is not None and inputs.mtbf_seconds is not None
    sized = inputs.checkpoint_bytes is not None
    interval = "the interval"
    size = "a checkpoint size"
    for option, given, needs, what, hint in (
        ("--restore-seconds", restore_seconds is not None, intervals, interval, _INTERVAL_HINT),
        ("--step-seconds", inputs.step_seconds is not None, intervals, interval, _INTERVAL_HINT),
        ("--plot", plot is not None, intervals, interval, _INTERVAL_HINT),
        ("--stall-seconds", inputs.stall_seconds is not None, sized, size, _SIZE_HINT),
        ("--keep", bool(inputs.keep), sized, size, _SIZE_HINT),
        ("--max-in-flight", max_in_flight is not None, bool(inputs.keep), "--keep", "add --keep"),
    ):
        if given and not needs:
            raise UsageError(f"{option} needs {what} to act on: {hint}")
    if restore_seconds is not None:
        require_non_negative("--restore-seconds", restore_seconds)
    if inputs.step_seconds is not None:
        require_positive("--step-seconds", inputs.step_seconds)
    if not intervals and not sized:
        raise UsageError(
            "nothing to plan: give --save-seconds with --mtbf-hours (the interval), "
            "--params with --recipe (the size), or --from STORE; see --help"
        )


def _json(
    answers: dict[str, object],
    size: _Size | None,
    sources: dict[str, str | None],
    plot: Path | None,
) -> dict[str, object]:
    """The plan's JSON with where its inputs came from."""
    answers["params"] = None if size is None else size.params
    answers["bytes_per_param"] = None if size is None else size.bytes_per_param
    answers["recipe"] = None if size is None else size.recipe
    answers["sources"] = {**sources, "checkpoint_bytes": None if size is None else size.source}
    answers["plot"] = None if plot is None else str(plot)
    return answers


def _size_note(size: _Size | None) -> str | None:
    if size is None:
        return None
    if size.params is None:
        return size.source
    recipe = f", {size.recipe}" if size.recipe else ""
    count = f"{size.params / 1e9:g}B" if size.params >= 10**9 else f"{size.params:,}"
    return f"{count} params × {size.bytes_per_param:g} B{recipe}"
