"""The writer process (``async_mode="process"``): hashes, writes and publishes.

Started by :class:`~ckptvault.saving.writer_process.WriterProcess` as
``python -m ckptvault.writer_main FD`` with one end of a socket pair. It
receives its settings, builds the same :class:`GenerationWriter` the training
process would (same store, run, contract, signing key, key store, ledger), says
``ready``, then serves one save at a time: it maps the staging slot the message
names (a file of its parent's under ``/dev/shm``), writes, signs and publishes the
generation exactly as the thread mode does, and answers with the result or the
error. Events (ledger, catalog, audit, metrics, replication, retention) are the
training process's: it announces what this process reports.

It ignores SIGINT and runs in its own session, so a Ctrl-C or a preemption signal
sent to the job's process group does not cut a save short; the training process
decides. When the training process is gone (its socket closes, or its pid is no
longer this process's parent) it removes its parent's staging files and exits at
once: a save whose requester died is never published; its staging is a leftover
that the next writer removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ckptvault.coordinator import Coordinator, SingleProcess
from ckptvault.distributed.save import CollectiveSave
from ckptvault.errors import CheckpointError, FormatError, SaveFailedError, UsageError
from ckptvault.events import EventBus
from ckptvault.run_context import RunContext
from ckptvault.saving.generation_writer import GenerationWriter, WriteSettings
from ckptvault.saving.shared_staging import PREFIX, SHM_DIR, Entry, map_file, stale_files, views
from ckptvault.saving.writer_wire import PeerGone, receive, send
from ckptvault.state.capture import CapturedState
from ckptvault.storage import open_store
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystores import open_keystore
from ckptvault.trust.ledger import Ledger
from ckptvault.trust.signing import load_private_key


def report_attempts(store: Any, report: Callable[[str], None]) -> None:
    """Tell the training process each attempt's generation id as it begins (if this
    process dies, the trainer looks the id up: :mod:`~ckptvault.saving.writer_recovery`),
    and publish nothing once the training process is gone."""
    begin, join_area = store.begin_generation, store.join_generation
    parent_pid = os.getppid()

    def guarded(area: Any) -> Any:
        publish = area.publish

        def publish_if_wanted(*args: Any, **kwargs: Any) -> Any:
            if os.getppid() != parent_pid:  # the requester died: never publish for it
                _abandon(parent_pid)
            return publish(*args, **kwargs)

        area.publish = publish_if_wanted
        return area

    def begin_generation(generation_id: str) -> Any:
        report(generation_id)
        return guarded(begin(generation_id))

    def join_generation(generation_id: str) -> Any:
        report(generation_id)
        return guarded(join_area(generation_id))

    store.begin_generation, store.join_generation = begin_generation, join_generation


def build_writer(
    config: dict[str, Any],
    coordinator: Coordinator | None = None,
    report: Callable[[str], None] | None = None,
) -> GenerationWriter:
    """The training process's writer, rebuilt from its settings; ``coordinator``: the
    writer processes' own group in a job of several ranks (see :func:`join`)."""
    pem = config.get("signing_key_pem")
    trust = TrustContext(
        signer=load_private_key(pem.encode()) if pem else None,
        keystore=open_keystore(config["keystore"]) if config.get("keystore") else None,
        ledger=Ledger(config["ledger"]) if config.get("ledger") else None,
    )
    store = open_store(config["location"], must_exist=False)
    if report is not None:
        report_attempts(store, report)
    run = RunContext(store, config["run_id"], trust, coordinator or SingleProcess(), EventBus())
    writer = GenerationWriter(
        run, config["contract"], WriteSettings(**config["settings"]), collective=CollectiveSave
    )
    writer.format_version = int(config["format_version"])
    writer.clean_staging = False  # the training process holds the lock and cleans
    return writer


def join(message: dict[str, Any]) -> Coordinator:
    """Join the writer processes' process group (gloo, over the TCP store rank 0's
    trainer hosts), the same ranks as the training job's; the coordinator of the
    collective saves run here."""
    from ckptvault.distributed.coordinator import TorchDistributed

    host, port, prefix = message["host"], message["port"], message["prefix"]
    rank, world, timeout = message["rank"], message["world"], message["timeout"]
    if not (
        isinstance(host, str)
        and isinstance(port, int)
        and isinstance(prefix, str)
        and isinstance(rank, int)
        and isinstance(world, int)
        and 0 <= rank < world
        and isinstance(timeout, (int, float))
        and timeout > 0
    ):
        raise FormatError(f"a malformed request to join the writers' group: {str(message)[:300]}")
    wait = timedelta(seconds=float(timeout))
    client = dist.TCPStore(host, port, is_master=False, timeout=wait)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, client), rank=rank, world_size=world, timeout=wait
    )
    return TorchDistributed(float(timeout))


class Slots:
    """The staging files mapped so far, by path (only the parent's, only under
    /dev/shm); a path no longer named is unmapped. DTensors are rebuilt on meshes
    of the writers' group, made once per mesh (making one is collective: every
    writer meets the same meshes in the same order, its job's state being saved by
    every rank alike)."""

    def __init__(self, parent_pid: int) -> None:
        self.prefix = str(SHM_DIR / f"{PREFIX}{parent_pid}-")
        self._mapped: dict[str, torch.Tensor] = {}
        self._meshes: dict[str, DeviceMesh] = {}

    def tensors(self, slot: dict[str, Any]) -> dict[str, torch.Tensor]:
        path, size = slot.get("path"), slot.get("size")
        if not (
            isinstance(path, str)
            and path.startswith(self.prefix)
            and "/" not in path[len(self.prefix) :]
        ):
            raise FormatError(
                f"staging slot {str(path)[:200]!r} is not one of this writer's parent's"
            )
        try:
            actual = os.stat(path).st_size
        except FileNotFoundError:
            raise SaveFailedError(
                f"staging slot {path} is gone (removed while the save waited); nothing was "
                "published, and the next save stages into a new one"
            ) from None
        if not isinstance(size, int) or actual != size:
            raise FormatError(f"staging slot {path}: its size is not {size!r}")
        for stale in [p for p in self._mapped if p != path and not os.path.exists(p)]:
            del self._mapped[stale]
        if path not in self._mapped:
            self._mapped[path] = map_file(path, size)
        entries = [_entry(raw, size) for raw in slot.get("tensors", [])]
        tensors = views(self._mapped[path], entries)
        for name, spec in dict(slot.get("dtensors") or {}).items():
            if name not in tensors:
                raise FormatError(f"staging slot: DTensor {str(name)[:200]!r} is not staged")
            tensors[name] = self._dtensor(tensors[name], spec)
        return tensors

    def _dtensor(self, local: torch.Tensor, spec: dict[str, Any]) -> DTensor:
        try:
            mesh_spec = spec["mesh"]
            key = json.dumps(mesh_spec, sort_keys=True)
            if key not in self._meshes:
                names = mesh_spec["names"]
                self._meshes[key] = DeviceMesh(
                    "cpu",
                    torch.tensor(mesh_spec["ranks"]).reshape(mesh_spec["shape"]),
                    mesh_dim_names=tuple(names) if names else None,
                )
            placements = [
                Shard(int(p[1])) if p[0] == "shard" else Replicate() for p in spec["placements"]
            ]
            return DTensor.from_local(
                local,
                self._meshes[key],
                placements,
                run_check=False,
                shape=torch.Size(spec["shape"]),
                stride=tuple(spec["stride"]),
            )
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise FormatError(f"staging slot: a malformed DTensor spec ({exc})") from exc


def _entry(raw: Any, size: int) -> Entry:
    try:
        name, dtype, shape, offset, nbytes = raw
        entry = Entry(str(name), str(dtype), tuple(int(d) for d in shape), int(offset), int(nbytes))
    except (TypeError, ValueError) as exc:
        raise FormatError(f"staging slot entry {str(raw)[:200]!r} is malformed") from exc
    if entry.offset < 0 or entry.nbytes < 0 or entry.offset + entry.nbytes > size:
        raise FormatError(f"staging slot entry {entry.name!r} lies outside its slot")
    return entry


def save(writer: GenerationWriter, slots: Slots, message: dict[str, Any]) -> dict[str, Any]:
    """One save; the reply the training process turns into its result."""
    captured = CapturedState(
        message["tree"], slots.tensors(message["slot"]), message.get("rank_tree")
    )
    writer.parent = message.get("parent")
    written = writer.write(int(message["step"]), captured, message.get("metrics"))
    info = written.info
    return {
        "ok": {
            "step": info.step,
            "generation_id": info.generation_id,
            "path": info.path,
            "bytes": info.bytes,
            "created_at": info.created_at,
            "seconds": written.seconds,
            "reused_plan": written.reused_plan,
            "kek_id": written.kek_id,
            "stages": written.stages,
        }
    }


def describe(exc: BaseException) -> dict[str, Any]:
    """An error as the training process rebuilds it (its type's name, its message,
    an OSError's errno)."""
    message = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        message = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return {
        "type": type(exc).__name__,
        "checkpoint_error": isinstance(exc, CheckpointError),
        "errno": exc.errno if isinstance(exc, OSError) else None,
        "message": message[:20000],
    }


def _watch_parent(parent_pid: int) -> None:
    """Exit at once, without publishing, when the training process is gone."""
    while True:
        time.sleep(0.2)
        if os.getppid() != parent_pid:
            _abandon(parent_pid)


def _abandon(parent_pid: int) -> None:
    for path in stale_files(parent_pid):
        with contextlib.suppress(OSError):
            path.unlink()
    os._exit(3)


def serve(sock: socket.socket, parent_pid: int) -> None:
    config = receive(sock, "the writer process's settings")
    try:
        coordinator = None
        if config.get("world", 1) > 1:  # a job of several ranks: join the writers first
            send(sock, {"op": "started", "pid": os.getpid()})
            coordinator = join(receive(sock, "a request to join the writers' group"))
        writer = build_writer(
            config,
            coordinator,
            lambda generation_id: send(sock, {"op": "begun", "generation_id": generation_id}),
        )
    except BaseException as exc:
        send(sock, {"op": "failed", "error": describe(exc)})
        return
    send(sock, {"op": "ready", "pid": os.getpid()})
    slots = Slots(parent_pid)
    while True:
        try:
            message = receive(sock, "a save request")
        except PeerGone:
            _abandon(parent_pid)
        if message.get("op") == "stop":
            writer.close()
            if dist.is_initialized():
                dist.destroy_process_group()
            return
        try:
            reply = save(writer, slots, message)
        except BaseException as exc:  # every failure goes back; none ends the process
            reply = {"error": describe(exc)}
        send(sock, reply)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        raise UsageError("usage: python -m ckptvault.writer_main FD (started by ckptvault)")
    parent_pid = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: _abandon(parent_pid))
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    sock = socket.socket(fileno=int(argv[0]))
    serve(sock, parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
