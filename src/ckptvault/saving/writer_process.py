"""The training process's side of ``async_mode="process"``: a long-lived writer.

An asynchronous save stages the state into shared memory
(:mod:`~ckptvault.saving.shared_staging`) and returns; the scheduler's background
thread then hands the save to the writer process
(:mod:`~ckptvault.writer_main`) and waits, blocked on a socket, while that
process hashes, writes, signs and publishes. The training process's interpreter is
left to training: the thread mode's Python work (DCP planning, the manifest, the
per-chunk loop) holds the GIL, this one's does not.

The trust and publish rules are those of the thread mode, because the writer
process runs the same :class:`~ckptvault.saving.generation_writer.GenerationWriter`
with the same settings; only the events (ledger, catalog, audit, metrics,
replication, retention) stay here, told when the writer process reports a
generation published. This process keeps the store's writer lock and removes
staging leftovers before each save it sends.

A writer process that dies (killed, OOM) is noticed while its save is awaited: the
save fails with :class:`~ckptvault.errors.SaveFailedError` (raised at the next
``save()``/``wait()`` as any background error), nothing of it was published (a
generation appears only by the atomic publish at its very end, which a dead
process did not reach), its staging is removed before the next save, and the next
save starts a new writer process.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import select
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any

from cryptography.hazmat.primitives import serialization

from ckptvault import errors
from ckptvault.errors import CheckpointError, SaveFailedError, UsageError
from ckptvault.saving.generation_writer import GenerationWriter, WrittenGeneration
from ckptvault.saving.writer_recovery import published_by_dead_writer
from ckptvault.saving.writer_wire import PeerGone, receive, send
from ckptvault.state.capture import CapturedState
from ckptvault.storage.listing import GenerationInfo
from ckptvault.storage.posix.store import PosixStore

START_TIMEOUT_S = 300.0  # importing torch on a loaded node can take a while
STOP_TIMEOUT_S = 30.0


def writer_settings(writer: GenerationWriter) -> dict[str, Any]:
    """What the writer process needs to build the same writer, as JSON. The signing
    key travels as PEM over the private socket pair to this process's own child."""
    if type(writer.store) is not PosixStore:
        raise UsageError(
            f"async_mode='process' writes to local or shared file systems; {writer.store.location} "
            "is not one. Use async_mode='thread' for this store"
        )
    trust = writer.trust
    signer = trust.signer
    pem = (
        signer.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        if signer is not None
        else None
    )
    return {
        "world": writer.coordinator.world_size,
        "location": writer.store.location,
        "run_id": writer.run_id,
        "contract": writer.contract,
        "settings": dataclasses.asdict(writer.settings),
        "format_version": writer.format_version,
        "signing_key_pem": pem,
        "keystore": trust.keystore.location if trust.keystore is not None else None,
        "ledger": str(trust.ledger.path) if trust.ledger is not None else None,
    }


class WriterProcess:
    """One writer process at a time, started on first use and after a death."""

    def __init__(self, writer: GenerationWriter, collective_timeout_s: float = 600.0) -> None:
        self.writer = writer
        self.coordinator = writer.coordinator
        self.timeout_s = collective_timeout_s
        self._settings = writer_settings(writer)  # refuses what it cannot serve, now
        self._rendezvous_store: Any = None  # rank 0's TCP store for the writers' group
        self._begun: str | None = None  # the generation id of the attempt in the process
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._lock = threading.Lock()
        self.starts = 0  # processes started (restarts show here)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the process if none is running; returns without waiting for it."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            self._discard()
            ours, theirs = socket.socketpair()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ckptvault.writer_main", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a signal to the job's group is the trainer's to handle
                stdin=subprocess.DEVNULL,
            )
            theirs.close()
            self._sock, self._ready = ours, False
            self.starts += 1
            send(ours, self._settings)

    def write(
        self,
        step: int,
        slot: dict[str, Any],
        captured: CapturedState,
        metrics: dict[str, int | float] | None,
    ) -> WrittenGeneration:
        """Save ``captured``, whose tensors are staged in ``slot``, through the writer
        process; returns what it published or raises what it raised. In a job of
        several ranks every rank calls it for the same save (it is collective)."""
        if self.coordinator.world_size > 1:
            self._ensure_group(step)
        else:
            self.start()
            self._await("ready", step)
        if self.coordinator.is_coordinator:
            self.writer.store.remove_stale_staging()  # we hold the lock; it does not
        message = {
            "op": "save",
            "step": step,
            "metrics": metrics,
            "tree": captured.tree,
            "rank_tree": captured.rank_tree,
            "parent": self.writer.parent,
            "slot": slot,
        }
        assert self._sock is not None
        self._begun = None
        try:
            self._send(message, step)
            reply = self._reply(step)
            while reply.get("op") == "begun":  # the attempt's generation id, first
                self._begun = str(reply.get("generation_id"))
                reply = self._reply(step)
        except _Died as death:
            found = published_by_dead_writer(self.writer, self._begun, step, death.how)
            if found is None:
                raise death.error from None
            self.writer.parent = found.info.generation_id
            return found
        if "error" in reply:
            if self.coordinator.world_size > 1:
                self._ready = False  # its group may be broken: the next save makes a new one
            raise rebuilt(reply["error"])
        written = written_from(reply.get("ok"))
        self.writer.parent = written.info.generation_id
        return written

    def close(self) -> None:
        """Stop the process after the save it is doing (if any)."""
        with self._lock:
            if self._proc is None:
                return
            try:
                if self._sock is not None:
                    send(self._sock, {"op": "stop"})
                self._proc.wait(STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
            self._discard()

    # -- waiting ---------------------------------------------------------------------

    def _send(self, message: dict[str, Any], step: int) -> None:
        assert self._sock is not None
        try:
            send(self._sock, message)
        except OSError:
            raise self._died(step) from None

    def _await(self, op: str, step: int) -> None:
        """Wait for the process to say ``op`` ("started": it runs; "ready": it
        serves saves)."""
        if self._ready:
            return
        try:
            reply = self._reply(step, START_TIMEOUT_S)
        except _Died as death:
            raise death.error from None
        if reply.get("op") != op:
            error = reply.get("error") or {}
            raise SaveFailedError(
                f"the writer process could not start: {error.get('type')}: "
                f"{error.get('message')}. Nothing was saved; fix that, or use "
                "async_mode='thread'"
            )
        self._ready = op == "ready"

    # -- many ranks: the writers' own process group ---------------------------------------

    def _ensure_group(self, step: int) -> None:
        """Every rank's writer runs in one group, or every rank starts a new one.

        The writer processes save collectively, in a gloo group of their own with
        the job's ranks. When any rank's writer is not serving (first save, or one
        died and broke the group), every rank replaces its writer and they form a
        new group: a group cannot take a new member in place of a dead one."""
        healthy = self._ready and self._proc is not None and self._proc.poll() is None
        if all(flag is True for flag in self.coordinator.all_gather(healthy)):
            return
        self._kill()
        self.start()
        self._await("started", step)
        offer = self._rendezvous() if self.coordinator.is_coordinator else None
        place = self.coordinator.broadcast(offer)
        if not (
            isinstance(place, dict)
            and isinstance(place.get("host"), str)
            and isinstance(place.get("port"), int)
            and isinstance(place.get("prefix"), str)
        ):
            raise SaveFailedError(
                f"rank 0 sent a malformed writers' rendezvous: {str(place)[:200]}"
            )
        join = {
            **place,
            "rank": self.coordinator.rank,
            "world": self.coordinator.world_size,
            "timeout": self.timeout_s,
        }
        try:
            self._send(join, step)
        except _Died as death:
            raise death.error from None
        self._await("ready", step)

    def _rendezvous(self) -> dict[str, Any]:
        """Rank 0: where the writers meet, under a fresh key prefix: the job's own TCP
        store (no new port: torchrun's, or what init_process_group made), else one
        this process hosts (made once)."""
        import torch.distributed as dist

        prefix = f"ckptvault-writers/{secrets.token_hex(8)}"
        address = job_store_address()
        if address is not None:
            return {"host": address[0], "port": address[1], "prefix": prefix}
        if self._rendezvous_store is None:
            self._rendezvous_store = dist.TCPStore(
                "0.0.0.0",
                0,
                None,
                True,
                timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
            )
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        return {"host": host, "port": int(self._rendezvous_store.port), "prefix": prefix}

    def _kill(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._discard()

    def _reply(self, step: int, timeout: float | None = None) -> dict[str, Any]:
        """The process's next message; :class:`_Died` when it died while waiting."""
        assert self._sock is not None and self._proc is not None
        waited = 0.0
        while True:
            readable, _, _ = select.select([self._sock], [], [], 0.5)
            if readable:
                try:
                    return receive(self._sock, "the writer process's reply")
                except (PeerGone, OSError):
                    raise self._died(step) from None
            if self._proc.poll() is not None:
                raise self._died(step)
            waited += 0.5
            if timeout is not None and waited >= timeout:
                self._proc.kill()
                raise self._died(step)

    def _died(self, step: int) -> _Died:
        assert self._proc is not None
        pid = self._proc.pid
        try:
            code = self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        with self._lock:
            self._discard()
        return _Died(
            f"died ({how})",
            SaveFailedError(
                f"the writer process (pid {pid}) died ({how}) while saving step {step}. Nothing "
                "of that save was published; its staging is removed before the next save, "
                "which starts a new writer process"
            ),
        )

    def _discard(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._proc, self._sock, self._ready = None, None, False


def job_store_address() -> tuple[str, int] | None:
    """The host and port of the default process group's TCP store, if it has one."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    try:
        store = distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return str(store.host), int(store.port)
    return None


class _Died(Exception):
    """The writer process died; ``error`` is what the save raises unless the store
    holds its generation (:mod:`~ckptvault.saving.writer_recovery`)."""

    def __init__(self, how: str, error: SaveFailedError) -> None:
        super().__init__(str(error))
        self.how, self.error = how, error


def written_from(ok: Any) -> WrittenGeneration:
    """A save's result from the writer process's reply (checked: it is input)."""
    try:
        info = GenerationInfo(
            int(ok["step"]),
            str(ok["generation_id"]),
            str(ok["path"]),
            int(ok["bytes"]),
            str(ok["created_at"]),
        )
        stages = {str(k): float(v) for k, v in dict(ok.get("stages") or {}).items()}
        kek = ok.get("kek_id")
        return WrittenGeneration(
            info,
            float(ok["seconds"]),
            bool(ok["reused_plan"]),
            str(kek) if kek is not None else None,
            stages=stages,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SaveFailedError(f"the writer process's reply is malformed: {exc}") from exc


def rebuilt(error: Any) -> BaseException:
    """The writer process's error as this process raises it: a ckptvault error of the
    same type, an OSError with its errno, else a SaveFailedError naming it."""
    error = error if isinstance(error, dict) else {}
    name, message = str(error.get("type", "Error")), str(error.get("message", ""))
    cls = getattr(errors, name, None)
    if error.get("checkpoint_error") and isinstance(cls, type) and issubclass(cls, CheckpointError):
        try:
            return cls(message)
        except TypeError:  # a constructor that takes more than a message
            pass
    number = error.get("errno")
    if isinstance(number, int):
        return OSError(number, f"{message} (in the writer process)")
    return SaveFailedError(f"the writer process failed: {name}: {message}")
