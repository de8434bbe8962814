"""The crash harness's child side: what a forked child does until it is SIGKILLed.

Each child is forked fresh from the harness's zygote (``crash_harness.Zygote``) with
one job (a dict) and runs one mode:

- ``save``: restore the newest generation (reporting its step and whether it is
  bit-exact; with ``verify``, then everything ``check`` does: the restarted trainer
  is the fresh process that checks the last kill), then fill and save step after
  step (``fill`` makes the state a function of the step) until killed, or for
  ``more`` steps;
- ``check``: restore into a blank state (also from each of ``restore_tiers`` alone),
  run ``ckptvault verify --all`` on every tier (the command's own code, in this
  process), list the generations, exit;
- ``restore``: open the manager and restore (into a fresh local tier when the job
  says so: a new node that copies the generation back), the kill target of the
  restore scenario;
- ``gc``: finish what a killed gc left (the same command, uninterrupted), save a
  few more generations, then run ``ckptvault gc`` with ``--keep-last 1
  --delete-delay 0s --stale-after 0s``.

A child reports what it did as JSON lines in its events file, each written with one
``write`` (a kill never leaves half a line before the last one): ``restored``,
``ready``, ``begin``/``saved`` (synchronous), ``staged``/``durable`` (asynchronous:
durable once the handle's future resolved), ``error`` (a typed ckptvault error),
``crash`` (any other exception) and ``finished``. With ``kill_at`` set, the child
SIGKILLs itself at that numbered store mutation (rename, unlink, rmdir, fsync, ...,
or an S3 or Azure Blob request that writes or deletes) once ``armed``: a kill at an
exact, random point inside a short operation (:class:`KillSwitch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

import ckptvault as cv
from ckptvault.errors import CheckpointError
from support.crash_state import build, fill, mismatches

_MUTATIONS = ("rename", "replace", "unlink", "rmdir", "fsync", "mkdir", "ftruncate")
_S3_MUTATIONS = {
    "PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
    "AbortMultipartUpload", "DeleteObject", "DeleteObjects", "CopyObject",
}  # fmt: skip


class Events:
    """The events file: one JSON object per line, each written with one write()."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"e": kind, "t": time.monotonic(), **fields}) + "\n"
        os.write(self.fd, line.encode())


class KillSwitch:
    """SIGKILL this process at the ``at``-th store mutation after ``arm()``: a
    filesystem call (rename, unlink, fsync, ...) or an S3 or Azure Blob request that
    writes or deletes (killed before it is sent when ``at`` is odd, after its response
    came back when even). Only calls from threads whose name starts with ``thread`` count,
    when given."""

    def __init__(self, at: int | None, events: Events, thread: str | None = None) -> None:
        self.at, self.events, self.thread = at, events, thread
        self.count, self.armed = 0, False
        self.lock = threading.Lock()
        for name in _MUTATIONS:
            setattr(os, name, self._counted(name, getattr(os, name)))
        import botocore.endpoint

        endpoint = botocore.endpoint.Endpoint
        endpoint.make_request = self._counted_request(endpoint.make_request)  # type: ignore[method-assign]
        with contextlib.suppress(ImportError):  # ckptvault[azure] not installed: no az:// jobs
            from azure.core.pipeline.transport import RequestsTransport

            RequestsTransport.send = self._counted_azure(RequestsTransport.send)  # type: ignore[method-assign]

    def _counts(self) -> bool:
        name = threading.current_thread().name
        return self.armed and (self.thread is None or name.startswith(self.thread))

    def _tick(self) -> int:
        """Number this mutation (0 when not counted)."""
        if not self._counts():
            return 0
        with self.lock:
            self.count += 1
            return self.count

    def _die(self, call: str, n: int, when: str) -> None:
        self.events.emit("self-kill", call=call, n=n, when=when)
        os.kill(os.getpid(), signal.SIGKILL)

    def _counted(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._tick() == self.at:
                self._die(name, self.at, "before")
            return call(*args, **kwargs)

        return counted

    def _counted_request(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(endpoint: Any, operation: Any, request: Any) -> Any:
            n = self._tick() if operation.name in _S3_MUTATIONS else 0
            if n and n == self.at and n % 2:
                self._die(operation.name, n, "before")
            response = call(endpoint, operation, request)
            if n and n == self.at:
                self._die(operation.name, n, "after")
            return response

        return counted

    def _counted_azure(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """Azure Blob requests that write or delete: every PUT (Put Blob, Put Block,
        Put Block List, leases) and DELETE, killed before or after as S3's are."""

        def counted(transport: Any, request: Any, **kwargs: Any) -> Any:
            n = self._tick() if request.method in ("PUT", "DELETE") else 0
            name = f"{request.method} {'comp=' if 'comp=' in request.url else 'blob'}"
            name += request.url.split("comp=", 1)[1].split("&")[0] if "comp=" in request.url else ""
            if n and n == self.at and n % 2:
                self._die(name, n, "before")
            response = call(transport, request, **kwargs)
            if n and n == self.at:
                self._die(name, n, "after")
            return response

        return counted

    def arm(self) -> None:
        self.armed = True


def _options(job: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {"run_id": "crash", "collective_timeout_s": 10}
    if job.get("keep_last"):
        options["retention"] = cv.Retention(keep_last=job["keep_last"], delete_delay=0)
    if job.get("replica"):
        options["replicate_to"] = job["replica"]
    if job.get("async"):
        options.update(async_save=True, max_in_flight=1, if_busy="wait")
    if str(job["store"]).startswith("s3://"):
        options.update(s3_part_size=5 << 20, s3_max_concurrency=2)
    if job.get("trust"):  # signed, encrypted; the ledger and audit log by default
        keys = job["trust"]
        options.update(
            signing_key=keys["private"], trusted_keys=[keys["public"]], keystore=keys["keystore"]
        )
    return options


def _location(job: dict[str, Any]) -> Any:
    """Where a save loop or check saves and restores: ``job["store"]``; an ``az://``
    store opened with 1 MiB blocks (so the state's few MiB go up as several staged
    blocks and one commit: kills land between them; the manager takes no block size)."""
    if not str(job["store"]).startswith("az://"):
        return job["store"]
    from ckptvault.storage.azure.options import AzureOptions
    from ckptvault.storage.azure.store import AzureStore

    return AzureStore(job["store"], AzureOptions(block_size=1 << 20, max_concurrency=2))


def _blank(job: dict[str, Any], world: int = 1) -> dict[str, Any]:
    return build(job["ballast_mb"], sharded=job.get("sharded", False), world=world)


def _report_restore(
    events: Events, kind: str, location: str, info: Any, state: dict[str, Any], **check: Any
) -> int:
    """Emit what a restore gave (step, what differs from that step, what it skipped)."""
    step = info.step if info is not None else -1
    events.emit(
        kind,
        location=location,
        step=step,
        wrong=mismatches(state, step, **check) if info is not None else [],
        skipped=[[s.step, s.reason] for s in info.skipped] if info is not None else [],
    )
    return step


def _check_tiers(job: dict[str, Any], events: Events) -> None:
    """Restore from each of ``restore_tiers`` alone, then list and ``verify --all``
    every tier of ``tiers``."""
    for location in job.get("restore_tiers", []):
        state = _blank(job)
        with cv.CheckpointManager(location, run_id="crash") as mgr:
            _report_restore(events, "restored-tier", location, mgr.restore(state), state)
    trusted = ["--trusted-key", job["trust"]["public"]] if job.get("trust") else []
    for tier in job.get("tiers", [job["store"]]):
        listed = _listing(tier)
        verified = _verify(tier, trusted) if listed else 0  # verify refuses an empty store
        events.emit("tier", location=tier, listed=listed, verify=verified)
    if job.get("trust"):  # the audit log's hash chain and head (a torn append is no tamper)
        from ckptvault import cli

        events.emit("audit", rc=cli.main(["audit", "verify"]))


def save_loop(job: dict[str, Any], events: Events, switch: KillSwitch) -> None:
    """Restore (with ``verify``: and check every tier, as ``check`` does), then save
    step after step: forever, or ``more`` steps."""
    rank, world = job.get("rank", 0), job.get("world", 1)
    state = _blank(job, world)
    with cv.CheckpointManager(_location(job), **_options(job)) as mgr:
        info = mgr.restore(state)
        step = _report_restore(events, "restored", job["store"], info, state, rank=rank)
        if job.get("verify"):
            _check_tiers(job, events)
        if job.get("async"):
            mgr.prepare(state)  # staging buffers made ready in the background, as advised
        events.emit("ready")
        switch.arm()
        limit = step + job.get("more", 10**9)
        while step < limit:
            step += 1
            fill(state, step, rank)
            events.emit("begin", step=step)
            handle = mgr.save(step, state)
            if not job.get("async"):
                events.emit("saved", step=step)
                continue
            events.emit("staged", step=step)
            handle.future.add_done_callback(  # type: ignore[union-attr]
                lambda future, s=step: events.emit(
                    "durable" if future.exception() is None else "failed", step=s
                )
            )
        mgr.wait()


def _verify(location: str, options: list[str]) -> int:
    from ckptvault import cli

    return cli.main(["verify", location, "--all", *options])


def _listing(location: str) -> list[list[Any]]:
    from ckptvault.storage import open_store

    store = open_store(location)
    return [[ref.step, ref.generation_id] for ref in store.list_generations()]


def check(job: dict[str, Any], events: Events, _switch: KillSwitch) -> None:
    """A fresh process's restore (per-rank RNGs are not checked after a restore onto
    another world size), then :func:`_check_tiers`."""
    state = _blank(job)
    with cv.CheckpointManager(_location(job), **_options(job)) as mgr:
        info = mgr.restore(state)
    _report_restore(events, "restored", job["store"], info, state, rng=not job.get("sharded"))
    _check_tiers(job, events)


def restore_once(job: dict[str, Any], events: Events, switch: KillSwitch) -> None:
    """Restore (from ``store``, or into the empty ``fresh`` tier with ``store`` as the
    remote one, which copies the generation back), reporting each stage."""
    state = _blank(job)
    if job.get("fresh"):
        mgr = cv.CheckpointManager(job["fresh"], run_id="crash", replicate_to=job["store"])
    else:
        mgr = cv.CheckpointManager(job["store"], run_id="crash")
    events.emit("ready")
    switch.arm()
    info = mgr.restore(state)
    events.emit("restored", step=info.step if info is not None else -1)
    mgr.close()  # waits for the copy back into the fresh tier


def gc_run(job: dict[str, Any], events: Events, switch: KillSwitch) -> None:
    """Finish what an earlier (killed) gc left with the same command, uninterrupted
    (``recovered``: its exit status and the generations left), save ``saves`` more
    generations, then run ``ckptvault gc --keep-last 1`` in this process: every run
    has the same work, however many runs were killed before."""
    from ckptvault import cli

    argv = ["gc", job["store"], "--keep-last", "1", "--delete-delay", "0s", "--stale-after", "0s"]
    if _listing(job["store"]):
        code = cli.main(argv)
        events.emit("recovered", rc=code, listed=_listing(job["store"]))
    state = _blank(job)
    with cv.CheckpointManager(job["store"], run_id="crash") as mgr:
        newest = max((g.step for g in mgr.generations()), default=-1)
        for step in range(newest + 1, newest + 1 + job["saves"]):
            fill(state, step)
            mgr.save(step, state)
            events.emit("saved", step=step)
    events.emit("ready")
    switch.arm()
    events.emit("gc-done", rc=cli.main(argv))


def _init_distributed(job: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job['port']}",
        rank=job["rank"],
        world_size=job["world"],
        timeout=timedelta(seconds=30),
    )


def main(job: dict[str, Any]) -> None:
    """A forked child's entry point: set up, run ``job['mode']``, report, exit."""
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(job.get("env", {}))
    torch.set_num_threads(1)
    events = Events(job["events"])
    switch = KillSwitch(job.get("kill_at"), events, job.get("kill_thread"))
    code = 0
    try:
        if job.get("world", 1) > 1:
            _init_distributed(job)
        modes = {"save": save_loop, "check": check, "restore": restore_once, "gc": gc_run}
        if job["mode"] in modes:  # else "noop": start-up only
            modes[job["mode"]](job, events, switch)
        events.emit("finished", calls=switch.count)
    except CheckpointError as exc:
        events.emit("error", type=type(exc).__name__, message=str(exc)[:2000])
        code = 3
    except BaseException as exc:
        events.emit("crash", type=type(exc).__name__, message=traceback.format_exc()[-4000:])
        code = 4
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a failed rank leaves at once, as on a crash
