"""``async_mode="process"`` under attack: crashes at awkward moments, misuse of the
staging slots, forks. Real processes throughout.

The writer process is steered only through its environment: a ``sitecustomize``
module (written per test, found through ``PYTHONPATH``, imported by the child
interpreter at start-up) wraps :meth:`GenerationWriter.write` in that process, to
make it slow or to SIGKILL it right after it published. Nothing in the product is
patched in the test's own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import SaveFailedError

SHM = Path("/dev/shm")

HOOK = textwrap.dedent(
    """
    import os
    _how = os.environ.get("CKV_HOSTILE_HOOK")
    if _how:
        import signal, time
        from ckptvault.saving import generation_writer as _gw

        _original = _gw.GenerationWriter.write

        def _write(self, step, captured, metrics=None):
            if _how.startswith("slow:"):
                time.sleep(float(_how.split(":")[1]))
                return _original(self, step, captured, metrics)
            if _how.startswith("die-after-publish:"):
                written = _original(self, step, captured, metrics)
                if step == int(_how.split(":")[1]):
                    os.kill(os.getpid(), signal.SIGKILL)  # published, not yet answered
                return written
            return _original(self, step, captured, metrics)

        _gw.GenerationWriter.write = _write
    """
)


@pytest.fixture
def writer_hook(tmp_path, monkeypatch):
    """Steer the writer processes started from now on (see the module docstring)."""
    directory = tmp_path / "hook"
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(HOOK)
    paths = [str(directory), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))

    def set_hook(how: str) -> None:
        monkeypatch.setenv("CKV_HOSTILE_HOOK", how)

    return set_hook


def manifests(store: Path) -> dict[int, dict]:
    with cv.CheckpointManager(store, run_id="r") as mgr:
        return {
            g.step: json.loads((Path(g.path) / "manifest.json").read_text())
            for g in mgr.generations()
        }


def restored(store: Path, step: int, width: int) -> torch.Tensor:
    target = {"w": torch.full((width,), -1.0)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(target, step=step).step == step
    return target["w"]


# -- findings of the hostile review, fixed --------------------------------------------------


def test_prepare_while_a_save_is_in_flight_does_not_change_what_it_saves(tmp_path, writer_hook):
    """``prepare()`` is documented to be called "again if the layout changes", i.e.
    at any point of training, with saves in flight. In process mode it re-lays out
    and zeroes every shared slot, including the one the writer process is about to
    read: the generation is published, signed and verifiable, holding zeros."""
    writer_hook("slow:0.5")  # the writer reads the slot half a second after save() returned
    store = tmp_path / "store"
    state = {"w": torch.full((1024,), 7.0)}
    with cv.CheckpointManager(store, run_id="r", async_save=True, async_mode="process") as mgr:
        mgr.save(1, state)
        mgr.prepare(state)  # the same layout: "get the buffers ready"
        mgr.wait()
    assert restored(store, 1, 1024).unique().tolist() == [7.0], "step 1 was saved as zeros"


def test_a_writer_killed_after_publishing_is_not_reported_as_publishing_nothing(
    tmp_path, writer_hook
):
    """The writer publishes step 2 and dies before its reply. The trainer says "Nothing
    of that save was published", runs no events (catalog, ledger, metrics, retention)
    for a generation that restore will pick, and the next save names step 1 as its
    parent: the chain forks."""
    writer_hook("die-after-publish:2")
    store = tmp_path / "store"
    state = {"w": torch.arange(16.0)}
    reported: list[int] = []
    failure = ""
    with cv.CheckpointManager(store, run_id="r", async_save=True, async_mode="process") as mgr:
        for step in (1, 2, 3):
            handle = mgr.save(step, state)
            try:
                reported.append(handle.result().step)
            except SaveFailedError as exc:
                failure = str(exc)
    on_disk = manifests(store)
    assert sorted(on_disk) == [1, 2, 3]  # step 2 WAS published (and restore would take it)
    assert "Nothing of that save was published" not in failure, failure
    assert reported == [1, 2, 3], f"the trainer reported only {reported} as saved"
    assert on_disk[3].get("parent") == on_disk[2]["generation_id"]


def test_a_forked_child_that_exits_normally_does_not_break_the_parents_saves(tmp_path):
    """``os.fork()`` after the writer started, the child ends normally (atexit runs):
    the inherited staging pool's finalizer unlinks the parent's slot files, and every
    later save of the parent fails (the slot's layout is unchanged, so it is never
    made again)."""
    store = tmp_path / "store"
    script = textwrap.dedent(
        f"""
        import os, sys, torch
        import ckptvault as cv
        mgr = cv.CheckpointManager({str(store)!r}, run_id="r", async_save=True,
                                   async_mode="process")
        state = {{"w": torch.ones(64)}}
        mgr.save(1, state).result()
        child = os.fork()
        if child == 0:
            sys.exit(0)  # e.g. a helper forked for a data pipeline, ending normally
        os.waitpid(child, 0)
        for step in (2, 3):
            try:
                mgr.save(step, state).result()
                print("saved", flush=True)
            except Exception as exc:
                print("failed:", type(exc).__name__, exc, flush=True)
        mgr.close()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["saved", "saved"], proc.stdout


# -- what held: kept as regression tests ---------------------------------------------------


def test_slots_in_flight_are_not_reused_even_when_the_layout_changes(tmp_path, writer_hook):
    """max_in_flight=2 with a slow writer: each save is restaged while earlier ones
    are still queued or being read, the layout changes between saves (a new slot
    file while the old one may still be mapped); every generation holds what was
    saved, in order, with the parent chain intact."""
    writer_hook("slow:0.2")
    store = tmp_path / "store"
    widths = {1: 64, 2: 64, 3: 128, 4: 32, 5: 32}
    with cv.CheckpointManager(
        store, run_id="r", async_save=True, async_mode="process", max_in_flight=2
    ) as mgr:
        for step, width in widths.items():
            state = {"w": torch.full((width,), float(step))}
            mgr.save(step, state)
            state["w"].fill_(-99.0)  # training moves on at once
        mgr.wait()
    on_disk = manifests(store)
    assert sorted(on_disk) == list(widths)
    for step in widths:
        assert restored(store, step, widths[step]).unique().tolist() == [float(step)]
        if step > 1:
            assert on_disk[step]["parent"] == on_disk[step - 1]["generation_id"]
    leftovers = list(SHM.glob(f"ckptvault-stage-{os.getpid()}-*"))
    assert leftovers == []


def test_an_interpreter_that_exits_without_close_finishes_its_save_and_cleans(tmp_path):
    store = tmp_path / "store"
    script = textwrap.dedent(
        f"""
        import os, torch
        import ckptvault as cv
        mgr = cv.CheckpointManager({str(store)!r}, run_id="r", async_save=True,
                                   async_mode="process")
        mgr.save(1, {{"w": torch.ones(8)}})
        mgr.save(2, {{"w": torch.full((1 << 20,), 2.0)}})
        print(os.getpid(), flush=True)
        """  # no wait(), no close()
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer = int(proc.stdout.split()[0])
    assert sorted(manifests(store)) == [1, 2]
    assert restored(store, 2, 1 << 20).unique().tolist() == [2.0]
    assert list(SHM.glob(f"ckptvault-stage-{trainer}-*")) == []


def test_slot_files_of_a_trainer_killed_with_its_writer_are_swept_by_the_next_one(tmp_path):
    """A cgroup kill, an OOM kill of both, ``kill -9`` of both: nobody removes the dead
    trainer's slot files (max_in_flight copies of the state, in RAM). The next job's
    trainer should sweep the slot files of processes that are gone."""
    store = tmp_path / "store"
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        import ckptvault as cv
        mgr = cv.CheckpointManager({str(store)!r}, run_id="r", async_save=True,
                                   async_mode="process")
        mgr.save(1, {{"w": torch.ones(1 << 18)}}).result()
        [writer] = [int(p) for p in os.listdir("/proc") if p.isdigit() and
                    b"writer_main" in open(f"/proc/{{p}}/cmdline", "rb").read()
                    and open(f"/proc/{{p}}/stat").read().rsplit(")", 1)[1].split()[1]
                    == str(os.getpid())]
        os.kill(writer, signal.SIGKILL)  # both die at once: the writer first
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    proc.wait(120)
    assert proc.returncode == -9
    leaked = list(SHM.glob(f"ckptvault-stage-{proc.pid}-*"))
    assert leaked, "the setup should leave the dead trainer's slot files"
    try:
        with cv.CheckpointManager(store, run_id="r", async_save=True, async_mode="process") as mgr:
            mgr.save(2, {"w": torch.ones(8)}).result()
        assert [p for p in leaked if p.exists()] == []
    finally:
        for path in leaked:  # never leave RAM behind on the shared machine
            path.unlink(missing_ok=True)
