"""One rank of a job in which rank 1 sends pickles (launched by ``multirank.launch``).

``python poison_worker.py poison STORE OUT``: rank 1 replaces, in turn, each message
it sends in a save and in a restore with a pickle whose unpickling would create
``OUT/PWNED``; both ranks record which of ckptvault's collectives ran, every call of
torch.distributed's pickled ``*_object`` collectives (refused, never run), and what
each poisoned save and restore raised. Writes ``OUT/rank<r>.json``
(``test_no_pickle_between_ranks.py`` checks it).

A rank sends data in a gather and an all-gather; in a broadcast or a scatter only
rank 0 does (the others' buffers are overwritten, never sent), so rank 1's
``_encode`` calls are exactly the messages it can poison.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import ckptvault as cv
from ckptvault.distributed import coordinator as wire
from support.rank_worker import COLS, RANK, ROWS, WORLD, full_of, manager, sharded, state_of

OBJECT_COLLECTIVES = (
    "gather_object",
    "all_gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
KINDS = ("barrier", "broadcast", "all_gather", "gather", "scatter")
SENDS = ("all_gather", "gather")  # the collectives in which every rank sends


class Payload:
    """Unpickling this opens (creates) the marker file: code run by the receiver."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


class Recorder:
    """Collectives of this rank, object-collective calls, and rank 1's poisoning."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker
        self.kinds: list[str] = []
        self.object_calls: list[str] = []
        self.sent = 0  # messages this rank encoded since the last reset
        self.poison_at: int | None = None

    def reset(self, poison_at: int | None = None) -> None:
        self.kinds, self.sent = [], 0
        self.poison_at = poison_at if RANK == 1 else None

    def install(self) -> None:
        encode = wire._encode

        def poisoned(value: Any) -> bytes:
            self.sent += 1
            if self.sent == self.poison_at:
                return pickle.dumps(Payload(str(self.marker)))
            return encode(value)

        wire._encode = poisoned
        for kind in KINDS:
            self._count(kind)
        for name in OBJECT_COLLECTIVES:
            refuse = self._refusal(name)
            setattr(dist, name, refuse)
            setattr(c10d, name, refuse)

    def _count(self, kind: str) -> None:
        original = getattr(wire.TorchDistributed, kind)

        def counted(coordinator: Any, *args: Any) -> Any:
            self.kinds.append(kind)
            return original(coordinator, *args)

        setattr(wire.TorchDistributed, kind, counted)

    def _refusal(self, name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> None:
            self.object_calls.append(name)
            raise AssertionError(f"torch.distributed.{name} was called: it unpickles")

        return refuse


def fresh() -> dict[str, Any]:
    return {
        "model": {"w": sharded(torch.zeros(ROWS, COLS)), "b": torch.zeros(3)},
        "rng": cv.RNGState(),
        "meta": {"tokens_seen": 0},
    }


def untouched(live: dict[str, Any]) -> bool:
    model = live["model"]
    return bool(
        torch.equal(full_of(model["w"]), torch.zeros(ROWS, COLS))
        and torch.equal(model["b"], torch.zeros(3))
        and live["meta"] == {"tokens_seen": 0}
    )


def attempt(action: Any) -> list[str] | None:
    """What ``action`` raised (a ckptvault error), or None."""
    try:
        action()
    except cv.errors.CheckpointError as exc:
        return [type(exc).__name__, str(exc)[:400]]
    return None


def poison_saves(mgr: cv.CheckpointManager, rec: Recorder, out: dict[str, Any]) -> None:
    rec.reset()
    mgr.save(1, state_of(1))  # clean: which collectives a save runs
    out["save_kinds"], out["save_sent"] = rec.kinds, rec.sent
    out["saves"] = []
    for n in range(1, sum(kind in SENDS for kind in rec.kinds) + 1):
        rec.reset(poison_at=n)
        error = attempt(lambda n=n: mgr.save(10 + n, state_of(10 + n)))
        rec.reset()
        out["saves"].append(
            {
                "error": error,
                "steps": sorted(g.step for g in mgr.generations()),
                "marker": rec.marker.exists(),
            }
        )
    mgr.save(100, state_of(100))  # a clean save still works afterwards
    out["after_saves"] = sorted(g.step for g in mgr.generations())


def poison_restores(mgr: cv.CheckpointManager, rec: Recorder, out: dict[str, Any]) -> None:
    rec.reset()
    info = mgr.restore(fresh())  # clean: which collectives a restore runs
    out["restore_kinds"], out["restore_sent"] = rec.kinds, rec.sent
    out["restored_step"] = info.step if info else None
    out["restores"] = []
    for n in range(1, sum(kind in SENDS for kind in rec.kinds) + 1):
        live = fresh()
        rec.reset(poison_at=n)
        error = attempt(lambda live=live: mgr.restore(live))
        rec.reset()
        out["restores"].append(
            {"error": error, "untouched": untouched(live), "marker": rec.marker.exists()}
        )
    live = fresh()
    info = mgr.restore(live)
    out["after_restores"] = [info.step if info else None, untouched(live)]


def poison(store: str, out_dir: str, out: dict[str, Any]) -> None:
    rec = Recorder(Path(out_dir) / "PWNED")
    rec.install()
    torch.manual_seed(100 + RANK)
    with manager(store) as mgr:
        poison_saves(mgr, rec, out)
        poison_restores(mgr, rec, out)
    out["object_calls"] = rec.object_calls
    out["marker"] = rec.marker.exists()


def forging(encode: Any, forged: dict[str, Any]) -> Any:
    """``encode``, but a verdict (a dict with ``problems``) is sent as ``forged``."""

    def forge(value: Any) -> bytes:
        is_verdict = isinstance(value, dict) and "problems" in value
        return encode(forged if is_verdict else value)

    return forge


def poison_plugin_choice(store: str, out_dir: str, out: dict[str, Any]) -> None:
    """The DCP plugin's reader chooses its generation with ckptvault's collectives
    (one verdict all-gather per candidate): rank 1 sends a pickle there, then a
    verdict that is JSON but not one ckptvault sends. Both ranks must refuse at once
    (never wait out the timeout). The save before it is plain ``dcp.save``, whose
    pickled collectives are the caller's (the recorder goes on after it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, storage_writer=cv.dcp.StorageWriter(store, run_id="p", step=1))
    rec = Recorder(Path(out_dir) / "PWNED")
    rec.install()
    out["choices"] = []
    forged = {"problems": [], "fatal": 5}
    for poisoned in ("pickle", "forged"):
        if poisoned == "forged" and RANK == 1:
            wire._encode = forging(wire._encode, forged)
        rec.reset(poison_at=1 if poisoned == "pickle" else None)
        error = attempt(lambda: cv.dcp.StorageReader(store, run_id="p", collective_timeout_s=60))
        out["choices"].append({"error": error, "marker": rec.marker.exists()})
    out["object_calls"] = rec.object_calls


def main() -> None:
    scenario, store, out_dir = sys.argv[1:4]
    assert scenario in ("poison", "plugin") and WORLD == 2
    dist.init_process_group("gloo")
    out: dict[str, Any] = {"rank": RANK, "world": WORLD}
    try:
        if scenario == "plugin":
            poison_plugin_choice(store, out_dir, out)
        else:
            poison(store, out_dir, out)
    finally:
        Path(out_dir, f"rank{RANK}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
