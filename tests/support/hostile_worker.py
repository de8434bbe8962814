"""Restore and ``ckptvault export`` of hostile plots, in a process whose address
space is limited before anything is imported (``tests/security/test_hostile_corpus.py``
runs it for the enormous claims): a reader that sized a buffer from a claimed
length fails here even where the kernel would have lent the pages lazily.

Usage: ``python hostile_worker.py LIMIT_BYTES '[[plot root, base, step], ...]'``;
prints one JSON object per plot: the restore's outcome and the export's exit
status and output.
"""

from __future__ import annotations

import json
import resource
import sys

resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))

from pathlib import Path  # noqa: E402  (imports after the limit, on purpose)

import ckptvault as cv  # noqa: E402
from ckptvault.errors import NoValidCheckpoint  # noqa: E402
from support.common import make_training_state  # noqa: E402
from support.hostile_plants import Plot  # noqa: E402
from support.hostile_points import cli_arguments, codes_of, in_process_cli  # noqa: E402


def restore(plot: Plot) -> dict:
    try:
        with cv.CheckpointManager(plot.store, **plot.options()) as mgr:
            info = mgr.restore(make_training_state(seed=9))
    except NoValidCheckpoint as exc:
        rejected = [[step, codes_of(reason)] for _gen, step, reason in exc.rejected]
        return {"refused": type(exc).__name__, "rejected": rejected}
    except BaseException as exc:  # what the parent must see: anything raw
        return {"raised": f"{type(exc).__name__}: {str(exc)[:300]}"}
    assert info is not None
    return {"step": info.step, "skipped": [[s.step, codes_of(s.reason)] for s in info.skipped]}


def main() -> None:
    for root, base, step in json.loads(sys.argv[2]):
        plot = Plot(base, Path(root))
        exported = in_process_cli(*cli_arguments("export", plot, step))
        print(json.dumps({"restore": restore(plot), "export": exported}), flush=True)


if __name__ == "__main__":
    main()
