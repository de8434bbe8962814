"""One rank of a job in which rank 1 sends JSON that is valid but not what ckptvault
sends (launched by ``multirank.launch``; ``test_security_round3b.py`` checks it).

``python dishonest_worker.py dishonest STORE OUT``:

- ``preempted``: rank 1 answers the preemption all-gather with the string ``"yes"``
  instead of ``false`` (truthy: before the fix every rank took it for a signal);
- ``oversized``: with the bound on what one all-gather may bring every rank lowered to
  1 MiB (as 4 GiB stands to a job of thousands of ranks), rank 1 sends 600 kB: every
  rank would receive (and allocate) the longest message once per rank;
- ``after``: a clean all-gather, so the ranks are still in step.

Writes ``OUT/rank<r>.json`` with what each call returned or raised.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

import ckptvault as cv
from ckptvault.distributed import coordinator as wire
from support.rank_worker import RANK, WORLD, manager


def outcome(action: Any) -> Any:
    """What ``action`` returned, or the ckptvault error it raised."""
    try:
        return {"value": action()}
    except cv.errors.CheckpointError as exc:
        return {"error": [type(exc).__name__, str(exc)[:300]]}


def dishonest(store: str, out: dict[str, Any]) -> None:
    encode = wire._encode
    with manager(store, save_on_signal=(signal.SIGUSR1,)) as mgr:
        if RANK == 1:  # a truthy answer that is not a yes/no
            wire._encode = lambda value: b'"yes"' if value is False else encode(value)
        out["preempted"] = outcome(lambda: mgr.preempted)
        wire._encode = encode
        wire._MAX_GATHERED = 1 << 20  # on every rank alike, as the real bound is
        big = "x" * 600_000 if RANK == 1 else "ok"
        out["oversized"] = outcome(lambda: len(mgr.coordinator.all_gather(big)[1]))
        out["after"] = outcome(lambda: mgr.coordinator.all_gather(RANK))


def main() -> None:
    scenario, store, out_dir = sys.argv[1:4]
    assert scenario == "dishonest" and WORLD == 2
    dist.init_process_group("gloo")
    out: dict[str, Any] = {"rank": RANK, "world": WORLD}
    try:
        dishonest(store, out)
    finally:
        Path(out_dir, f"rank{RANK}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
