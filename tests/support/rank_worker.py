"""One rank of a multi-rank test job (launched by ``multirank.launch``).

``python rank_worker.py SCENARIO STORE OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in the environment; writes what it saw to ``OUT/rank<r>.json``. The
state is a small "model": a weight sharded by rows over the ranks (a DTensor, as
FSDP2 holds it), a replicated bias, the global RNGs (per rank) and a counter (global).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import ckptvault as cv
from ckptvault.errors import CheckpointError

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
# torchrun --nproc-per-node 1: a process group, and FSDP2's mesh, of one rank.
GROUP = WORLD > 1 or os.environ.get("ONE_RANK_GROUP") == "1"
ROWS, COLS = 10, 4  # 10 rows do not split evenly over 3 or 4 ranks: uneven shards


def weight(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * step


def sharded(full: torch.Tensor) -> torch.Tensor:
    if WORLD == 1:
        return full.clone()
    mesh = init_device_mesh("cpu", (WORLD,))
    return distribute_tensor(full.clone(), mesh, [Shard(0)])


def full_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def state_of(step: int) -> dict[str, Any]:
    return {
        "model": {"w": sharded(weight(step)), "b": torch.full((3,), float(step))},
        "rng": cv.RNGState(),
        "meta": {"tokens_seen": 1000 * step},
    }


def manager(store: str, **options: Any) -> cv.CheckpointManager:
    keystore = os.environ.get("TEST_KEYSTORE")  # an encrypted run, when set
    if keystore:
        options["keystore"] = keystore
    signing = os.environ.get("TEST_SIGNING_KEY")  # a signed run, when set
    if signing:
        options.update(signing_key=signing, trusted_keys=[os.environ["TEST_TRUSTED_KEY"]])
    if os.environ.get("TEST_AUDIT_LOG"):  # a ledger and audit log of the test's own
        options.setdefault("ledger", os.environ["TEST_LEDGER"])
        options.setdefault("audit_log", os.environ["TEST_AUDIT_LOG"])
    return cv.CheckpointManager(store, run_id="job", collective_timeout_s=20, **options)


def save(store: str, out: dict[str, Any], steps: tuple[int, ...] = (1, 2), **kw: Any) -> None:
    torch.manual_seed(100 + RANK)
    with manager(store, **kw) as mgr:
        for step in steps:
            mgr.save(step, state_of(step))
        mgr.wait()
    out["after_save_draw"] = torch.rand(1).item()  # what a resumed rank must draw next


def restore(store: str, out: dict[str, Any]) -> None:
    torch.manual_seed(12345)  # the restore must replace this rank's RNG, or leave it
    live = {
        "model": {"w": sharded(torch.zeros(ROWS, COLS)), "b": torch.zeros(3)},
        "rng": cv.RNGState(),
        "meta": {"tokens_seen": 0},
    }
    with manager(store) as mgr:
        info = mgr.restore(live)
    assert info is not None
    w = live["model"]["w"]
    out.update(
        step=info.step,
        weight_exact=bool(torch.equal(full_of(w), weight(info.step))),
        local_rows=int(w.to_local().shape[0]) if isinstance(w, DTensor) else ROWS,
        bias=live["model"]["b"].tolist(),
        meta=live["meta"],
        reset=info.reset,
        skipped=[[s.step, s.reason] for s in info.skipped],
        draw=torch.rand(1).item(),
    )
    # Training goes on from the restored weights: one optimizer step on the shards.
    w.requires_grad_(True)
    optimizer = torch.optim.SGD([w], lr=0.5)
    (w * w).sum().backward()
    optimizer.step()
    out["after_step_exact"] = bool(torch.equal(full_of(w.detach()), weight(info.step) * 0.0))


def restore_older_step(store: str, out: dict[str, Any]) -> None:
    """With a ledger, step 1 below a newer step 2 that verifies: refused on every rank
    (nothing applied), then restored on purpose with allow_rollback_to=1."""
    live = {
        "model": {"w": sharded(torch.zeros(ROWS, COLS)), "b": torch.zeros(3)},
        "rng": cv.RNGState(),
        "meta": {"tokens_seen": 0},
    }
    with manager(store, ledger=os.environ["TEST_LEDGER"]) as mgr:
        try:
            mgr.restore(live, step=1)
        except cv.errors.RollbackError as exc:
            out["refused"] = str(exc).splitlines()[0]
        out["untouched"] = bool(torch.equal(live["model"]["b"], torch.zeros(3)))
        info = mgr.restore(live, allow_rollback_to=1)
    assert info is not None
    out.update(
        step=info.step, rolled_back_from=info.rolled_back_from, bias=live["model"]["b"].tolist()
    )


def fail_in_write(store: str, out: dict[str, Any]) -> None:
    """Rank 1's disk fails while it writes its shard."""
    from ckptvault.io import writer

    original = writer.VaultStorageWriter._write_file

    def broken(self: Any, name: str, items: Any, planner: Any) -> Any:
        if RANK == 1:
            raise OSError(5, "Input/output error (injected on rank 1)")
        return original(self, name, items, planner)

    save(store, out, steps=(1,))
    writer.VaultStorageWriter._write_file = broken  # type: ignore[method-assign]
    try:
        save(store, out, steps=(2,))
    except cv.errors.CheckpointError as exc:
        out["error"] = [type(exc).__name__, str(exc)]


def die_in_write(store: str, out: dict[str, Any]) -> None:
    """Rank 1 is killed (SIGKILL) in the middle of writing its shard of step 2."""
    from ckptvault.io import writer

    original = writer.VaultStorageWriter._write_file

    def killed(self: Any, name: str, items: Any, planner: Any) -> Any:
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, name, items, planner)

    save(store, out, steps=(1,))
    writer.VaultStorageWriter._write_file = killed  # type: ignore[method-assign]
    try:
        save(store, out, steps=(2,))
    except cv.errors.CheckpointError as exc:
        out["error"] = [type(exc).__name__, str(exc)]


def die_after_publish(store: str, out: dict[str, Any]) -> None:
    """Rank 0 is killed (SIGKILL) right after it published step 2, before it could tell
    rank 1: the generation is complete, and rank 1 cannot know it was published."""
    from ckptvault.distributed.save import CollectiveSave

    original = CollectiveSave._build_and_publish

    def published_then_killed(self: Any, *args: Any) -> Any:
        outcome = original(self, *args)
        if RANK == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return outcome

    save(store, out, steps=(1,))
    CollectiveSave._build_and_publish = published_then_killed  # type: ignore[method-assign]
    try:
        save(store, out, steps=(2,))
    except cv.errors.CheckpointError as exc:
        out["error"] = [type(exc).__name__, str(exc)]


def fsdp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP wrapped with FSDP2 (``fully_shard``) on this job's ranks, and AdamW
    over its sharded parameters, as a user builds them on any number of ranks."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)  # the same initial weights on every rank and world size
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6), torch.nn.Linear(6, 3)
    )
    if GROUP:
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in (model[0], model[2], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    batch = torch.Generator().manual_seed(seed)  # the same batch on every rank
    inputs = torch.randn(12, 8, generator=batch)
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and optimizer state tensor, whole, as lists (for comparing)."""
    params = {name: full_of(p.detach()).tolist() for name, p in model.named_parameters()}
    moments = {
        f"{index}/{name}": full_of(value).tolist()
        for index, p in enumerate(model.parameters())
        for name, value in optimizer.state[p].items()
    }
    return {"params": params, "moments": moments}


def fsdp_save(store: str, out: dict[str, Any]) -> None:
    model, optimizer = fsdp_model()
    for seed in (1, 2):
        train_step(model, optimizer, seed)
    with manager(store) as mgr:
        mgr.save(2, {"model": model, "optim": optimizer})
    out["saved"] = full_state(model, optimizer)
    train_step(model, optimizer, 3)  # what an uninterrupted run holds one step later
    out["continued"] = full_state(model, optimizer)


def fsdp_restore(store: str, out: dict[str, Any]) -> None:
    model, optimizer = fsdp_model()  # fresh: no optimizer state yet
    with manager(store) as mgr:
        info = mgr.restore({"model": model, "optim": optimizer})
    assert info is not None
    out["restored"] = full_state(model, optimizer)
    out["sharded"] = (
        all(
            isinstance(value, DTensor)
            for value in optimizer.state[next(iter(model.parameters()))].values()
            if value.dim() > 0
        )
        and WORLD > 1
    )
    train_step(model, optimizer, 3)  # training goes on from the restored state
    out["after_step"] = full_state(model, optimizer)


def recording_reads(scenario: Any) -> Any:
    """``scenario``, with every file name this rank opens recorded in ``out["opened"]``
    (an audit hook: the store opens entries relative to a directory descriptor)."""

    def run(store: str, out: dict[str, Any]) -> None:
        opened: list[str] = []

        def hook(event: str, args: tuple[Any, ...]) -> None:
            if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
                opened.append(os.path.basename(os.fsdecode(args[0])))

        sys.addaudithook(hook)
        scenario(store, out)
        out["opened"] = sorted(set(opened))

    return run


def replicas_disagree(store: str, out: dict[str, Any]) -> None:
    """Rank 1's copy of the replicated bias went bad (a flipped value)."""
    from torch.distributed.tensor import Replicate

    state = state_of(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    # A DTensor replicated over the mesh (HSDP's replicate dimension holds these).
    state["model"]["r"] = distribute_tensor(torch.ones(2, 2), mesh, [Replicate()])
    if RANK == 1:
        state["model"]["b"][1] += 1.0
        state["model"]["r"].to_local()[0, 0] = 5.0
    audit = Path(store).parent / "audit.jsonl"
    with manager(store, audit_log=audit) as mgr:  # "warn": published, reported
        mgr.save(1, state)
        out["mismatches"] = mgr.stats.replica_mismatches
    with manager(store, on_replica_mismatch="raise") as mgr:
        try:
            mgr.save(2, state)
        except cv.errors.CheckpointError as exc:
            out["error"] = [type(exc).__name__, str(exc)]


def restore_diverging_manifest(store: str, out: dict[str, Any]) -> None:
    """Rank 1 reads other manifest bytes for the newest generation than rank 0 did
    (a manifest swapped while the ranks read it): simulated by altering what rank 1's
    checks return, so that the ranks cannot agree."""
    from dataclasses import replace

    from ckptvault.distributed import restore as collective

    original = collective.prepare_load

    def diverging(store_: Any, ref: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = original(store_, ref, *args, **kwargs)
        if RANK == 1 and ref.step == 2:
            checked = replace(
                prepared.checked, manifest_bytes=prepared.checked.manifest_bytes + b" "
            )
            prepared = replace(prepared, checked=checked)
        return prepared

    collective.prepare_load = diverging  # type: ignore[assignment]
    restore(store, out)


def preempt_one_rank(store: str, out: dict[str, Any]) -> None:
    """Only rank 1 gets the scheduler's signal; both ranks must stop at the same save."""
    with manager(store, save_on_signal=(signal.SIGUSR1,)) as mgr:
        try:
            for step in range(1, 10):
                if step == 3 and RANK == 1:
                    signal.raise_signal(signal.SIGUSR1)
                mgr.save(step, state_of(step))
        except cv.Preempted as exc:
            out["preempted_step"] = exc.step
            out["code"] = exc.code


class Cursor:
    """A rank's own stateful object (a data position), wrapped in cv.PerRank."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def per_rank_entries(store: str, out: dict[str, Any]) -> None:
    """Entries wrapped in cv.PerRank: saved per rank, restored in place to their rank."""
    with manager(store) as mgr:
        mgr.save(
            1,
            {
                "w": torch.ones(2),
                "cursor": cv.PerRank(Cursor(10 + RANK)),
                "seen": cv.PerRank({"rank": RANK}),
            },
        )
        cursor, seen = Cursor(), {"rank": -1}
        live = {"w": torch.zeros(2), "cursor": cv.PerRank(cursor), "seen": cv.PerRank(seen)}
        info = mgr.restore(live)
    assert info is not None
    out.update(
        position=cursor.position,
        seen=seen,
        in_place=live["cursor"].value is cursor and live["seen"].value is seen,
    )


def memory_tier(store: str) -> cv.MemoryTier:
    """The job's memory tier: beside the store (one node: every rank shares it)."""
    return cv.MemoryTier(path=f"{store}-memory", keep=1, durable_every=2)


def memory_save(store: str, out: dict[str, Any]) -> None:
    """Steps 1..3 into the memory tier; step 2 also into the store."""
    torch.manual_seed(100 + RANK)
    with manager(store, memory_tier=memory_tier(store)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_of(step), blocking=True)


def restore_with_tier(store: str, tier: cv.MemoryTier, out: dict[str, Any]) -> None:
    """Restore the model with ``tier``: which step, from where, exact, what skipped."""
    live = {"model": {"w": sharded(torch.zeros(ROWS, COLS)), "b": torch.zeros(3)}}
    with manager(store, memory_tier=tier) as mgr:
        info = mgr.restore(live, strict=False)
    assert info is not None
    out.update(
        step=info.step,
        source=info.source,
        weight_exact=bool(torch.equal(full_of(live["model"]["w"]), weight(info.step))),
        skipped=[s.step for s in info.skipped],
    )


def memory_restore(store: str, out: dict[str, Any]) -> None:
    restore_with_tier(store, memory_tier(store), out)


def node_tier(store: str) -> cv.MemoryTier:
    """Two simulated nodes: ranks 0-1 on A, the rest on B, each with its own memory
    directory beside the store."""
    node = "A" if RANK < 2 else "B"
    os.environ["CKPTVAULT_NODE"] = node
    return cv.MemoryTier(path=f"{store}-memory-{node}", keep=1, durable_every=5, peers=1)


def nodes_save(store: str, out: dict[str, Any]) -> None:
    """Steps 1..13 into memory (every 5th into the store), then SIGKILL."""
    torch.manual_seed(100 + RANK)
    asynchronous = os.environ.get("TEST_ASYNC") == "1"  # saves staged, written behind
    mgr = manager(store, memory_tier=node_tier(store), async_save=asynchronous)
    for step in range(1, 14):
        mgr.save(step, state_of(step))
    mgr.wait()
    Path(sys.argv[3], f"rank{RANK}.json").write_text(json.dumps(out))
    os.kill(os.getpid(), signal.SIGKILL)  # every rank, at step 13


def nodes_restore(store: str, out: dict[str, Any]) -> None:
    restore_with_tier(store, node_tier(store), out)


def small_node_tier(store: str) -> cv.MemoryTier:
    """As :func:`node_tier`, with nothing durable (the memory tier alone)."""
    tier = node_tier(store)
    return cv.MemoryTier(path=tier.path, keep=1, durable_every=100, peers=1)


def nodes_peer_cannot_write(store: str, out: dict[str, Any]) -> None:
    """Steps 1 and 2 into memory; node B's first rank cannot write the copies it
    receives (its tmpfs is full: ENOSPC): the saves stand, quickly."""
    import errno
    import time

    from ckptvault.memory import writer
    from ckptvault.storage.posix import files

    if RANK == 2:
        copying = []
        to_peers, write = writer.copy_to_peers, files.PosixWritableFile.write

        def copy_to_peers(*args: Any) -> Any:
            copying.append(True)
            try:
                return to_peers(*args)
            finally:
                copying.pop()

        def full(self: Any, data: Any) -> int:
            if copying:
                raise files.translate_os_error(OSError(errno.ENOSPC, "full"), self.where)
            return write(self, data)

        writer.copy_to_peers = copy_to_peers  # type: ignore[assignment]
        files.PosixWritableFile.write = full  # type: ignore[method-assign]
    started = time.monotonic()
    with manager(store, memory_tier=small_node_tier(store)) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step), blocking=True)
    out["seconds"] = time.monotonic() - started


def nodes_save_two(store: str, out: dict[str, Any]) -> None:
    """Steps 1 and 2 into memory on nodes A and B (nothing durable)."""
    with manager(store, memory_tier=small_node_tier(store)) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step), blocking=True)


def nodes_copy_changed(store: str, out: dict[str, Any]) -> None:
    """As :func:`nodes_save_two`, but a byte of step 2 on node A changes while rank 0
    copies it to B (someone who can write A's memory): B must not publish that copy."""
    from ckptvault.memory import writer

    if RANK == 0:
        to_peers = writer.copy_to_peers

        def changed_while_copied(memory: Any, dirname: Any, peers: int) -> Any:
            if not str(dirname).startswith("step-000000000002."):
                return to_peers(memory, dirname, peers)
            [tensors] = sorted(Path(memory.location, dirname).glob("*.safetensors"))[:1]
            tensors.chmod(0o644)
            original = tensors.read_bytes()
            tensors.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
            try:
                return to_peers(memory, dirname, peers)
            finally:
                tensors.write_bytes(original)

        writer.copy_to_peers = changed_while_copied  # type: ignore[assignment]
    nodes_save_two(store, out)


def nodes_restore_two(store: str, out: dict[str, Any]) -> None:
    """A restore of what :func:`nodes_save_two` left, timed."""
    import time

    live = {"model": {"w": sharded(torch.zeros(ROWS, COLS)), "b": torch.zeros(3)}}
    started = time.monotonic()
    with manager(store, memory_tier=small_node_tier(store)) as mgr:
        info = mgr.restore(live, strict=False)
    assert info is not None
    out.update(
        step=info.step,
        source=info.source,
        seconds=time.monotonic() - started,
        weight_exact=bool(torch.equal(full_of(live["model"]["w"]), weight(info.step))),
    )


def one_name_two_machines(store: str, out: dict[str, Any]) -> None:
    """Every rank says it runs on node X, but ranks 2-3 have a directory of their own:
    two machines under one name."""
    os.environ["CKPTVAULT_NODE"] = "X"
    tier = cv.MemoryTier(path=f"{store}-memory-{RANK // 2}", keep=1)
    try:
        with manager(store, memory_tier=tier):
            pass
    except cv.errors.UsageError as exc:
        out["error"] = str(exc)


def process_writer_killed(store: str, out: dict[str, Any]) -> None:
    """async_mode="process": rank 1's writer process is SIGKILLed while the writers
    save step 2 together; every rank's step 2 fails, step 3 goes through new writers."""
    big = {"model": {"w": sharded(torch.randn(ROWS * 4096, 1024)), "b": torch.zeros(3)}}
    with manager(store, async_save=True, async_mode="process") as mgr:
        mgr.save(1, state_of(1)).result()
        writers = [child_writer()]
        handle = mgr.save(2, big)
        if RANK == 1:
            staging = Path(store, ".staging")
            while not any(staging.iterdir()):  # the writers began step 2
                pass
            os.kill(writers[0], signal.SIGKILL)
        try:
            handle.result()
            out["step2"] = "published"
        except CheckpointError as exc:
            out["step2"] = [type(exc).__name__, str(exc)[:500]]
        mgr.save(3, state_of(3)).result()
        writers.append(child_writer())
        out["new_writer"] = writers[1] != writers[0]
        out["steps"] = [g.step for g in mgr.generations()]


def child_writer() -> int:
    """This rank's writer process (as ps would find it)."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            mine = int(stat[1]) == os.getpid() and stat[0] != "Z"
            if mine and b"ckptvault.writer_main" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except OSError:
            continue
    raise AssertionError("no writer process")


SCENARIOS = {
    "save": save,
    "per_rank_entries": per_rank_entries,
    "preempt_one_rank": preempt_one_rank,
    "save_async": lambda store, out: save(store, out, async_save=True),
    "save_process": lambda store, out: save(store, out, async_save=True, async_mode="process"),
    "process_writer_killed": process_writer_killed,
    "restore": restore,
    "restore_older_step": restore_older_step,
    "fail_in_write": fail_in_write,
    "die_in_write": die_in_write,
    "die_after_publish": die_after_publish,
    "fsdp_save": fsdp_save,
    "restore_diverging_manifest": restore_diverging_manifest,
    "replicas_disagree": replicas_disagree,
    "fsdp_restore": fsdp_restore,
    "fsdp_restore_recording_reads": recording_reads(fsdp_restore),
    "restore_recording_reads": recording_reads(restore),
    "memory_save": memory_save,
    "memory_restore": memory_restore,
    "nodes_save": nodes_save,
    "one_name_two_machines": one_name_two_machines,
    "nodes_restore": nodes_restore,
    "nodes_peer_cannot_write": nodes_peer_cannot_write,
    "nodes_save_two": nodes_save_two,
    "nodes_copy_changed": nodes_copy_changed,
    "nodes_restore_two": nodes_restore_two,
}


def main() -> None:
    scenario, store, out_dir = sys.argv[1:4]
    if GROUP:
        dist.init_process_group("gloo")
    out: dict[str, Any] = {"rank": RANK, "world": WORLD}
    try:
        SCENARIOS[scenario](store, out)
    finally:
        Path(out_dir, f"rank{RANK}.json").write_text(json.dumps(out))
        if GROUP:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
