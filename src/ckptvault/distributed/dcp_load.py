"""DCP's load steps on one rank of many, with nothing sent between ranks.

``dcp.load`` on a process group gathers every rank's load plan to rank 0 and
scatters the global plan back with ``gather_object`` / ``scatter_object_list``
(pickle), then ``all_gather_object``\\ s every rank's outcome. For ckptvault's
planner and readers that exchange carries nothing: DCP's default load planner's
``create_global_plan`` returns the plans it is given
(``create_default_global_load_plan``), and so does
:meth:`~ckptvault.io.reader.VaultStorageReader.prepare_global_plan`. So each rank
runs DCP's steps in ``state_dict_loader``'s order on its own — ``set_up_planner``,
``set_up_storage_reader``, ``create_local_plan``, ``prepare_local_plan``,
``finish_plan``, ``read_data`` — and the ranks' outcomes are combined by the
restore's own verdict (a JSON all-gather: :meth:`CollectiveLoader.agree
<ckptvault.distributed.restore.CollectiveLoader.agree>`). :func:`check_local_only`
refuses a planner or reader whose global step would change the plans: skipping it
would then be wrong, not merely cheaper.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ckptvault.errors import UsageError
from ckptvault.io.planners import TensorOnlyLoadPlanner
from ckptvault.io.reader import VaultStorageReader


def check_local_only(planner: LoadPlanner, reader: VaultStorageReader) -> None:
    """Refuse a planner or reader that overrides DCP's global load step (the one
    step that would need the other ranks' plans)."""
    global_step = type(planner).create_global_plan
    prepare = type(reader).prepare_global_plan
    if (
        global_step is not DefaultLoadPlanner.create_global_plan
        or prepare is not VaultStorageReader.prepare_global_plan
    ):
        raise UsageError(
            f"{type(planner).__name__} or {type(reader).__name__} changes DCP's global load "
            "plan; ckptvault loads each rank's plan on its own and sends no plan between "
            "ranks. Keep the global step the identity, or carry plans as JSON"
        )


def load_local(
    destinations: dict[str, torch.Tensor], reader: VaultStorageReader, is_coordinator: bool
) -> None:
    """Fill ``destinations`` (this rank's private buffers) from ``reader``'s
    generation, through DCP's planner, without a collective. Raises what the planner
    or reader raised (typed ckptvault errors for bytes that do not verify)."""
    plan, planner = plan_local(destinations, reader, is_coordinator)
    reader.read_data(plan, planner).wait()


def plan_local(
    destinations: dict[str, torch.Tensor], reader: VaultStorageReader, is_coordinator: bool
) -> tuple[LoadPlan, LoadPlanner]:
    """DCP's steps before ``read_data`` on this rank alone: the plan that fills
    ``destinations``, and the planner that resolves its items. Reads no tensor byte."""
    planner = TensorOnlyLoadPlanner()
    check_local_only(planner, reader)
    metadata = reader.read_metadata()
    planner.set_up_planner(destinations, metadata, is_coordinator)
    reader.set_up_storage_reader(metadata, is_coordinator)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    return planner.finish_plan(plan), planner
