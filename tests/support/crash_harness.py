"""The crash harness's driver: fork children from a zygote, SIGKILL them, tally.

Starting a Python process that imports torch costs 1.5-2 s here, more than a kill
and its checks. So the harness starts one *zygote* — a process that imports torch,
ckptvault, boto3 and the worker once and then only forks — and every run is a child
forked from it: a fresh process (nothing of an earlier run's memory, locks or
threads), ready in tens of milliseconds. The zygote never runs a torch op, so no
thread pool exists when it forks. Children are plain processes: the driver kills
them with a real SIGKILL (``Child.kill``) and they die as a crashed trainer does.

:class:`Tally` counts what the scenarios report (kills, restores, kills that landed
mid-operation, recovered step against the last completed save) and collects every
failure with its seed, so that a scenario records its figures before it asserts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.forkserver import fork_loop

# Everything a child would otherwise import on its first save, restore, verify or gc
# (torch._dynamo alone, pulled in by the first optimizer, takes a second here).
PRELOAD = (
    "torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
    "torch.distributed.tensor", "torch.distributed.device_mesh", "torch.profiler",
    "numpy", "boto3", "prometheus_client", "prometheus_client.core", "pydantic",
    "typer._adapters", "typer._click.decorators", "rich._emoji_codes", "zoneinfo",
    "_strptime", "wsgiref.simple_server", "ckptvault", "ckptvault.manager", "ckptvault.cli",
    "ckptvault.distributed.coordinator", "ckptvault.distributed.replicas",
    "ckptvault.storage.s3.store", "ckptvault.storage.azure.store", "azure.storage.blob",
    "support.crash_state", "support.crash_worker",
)  # fmt: skip
_ENV = (
    "XDG_STATE_HOME",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "AWS_EC2_METADATA_DISABLED",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ENDPOINT_URL",
    "AZURE_STORAGE_CONNECTION_STRING",
)


def serve() -> None:
    """The zygote process: import everything once, then fork one child per job
    (``forkserver.fork_loop``), each running ``crash_worker``."""
    fork_loop(PRELOAD, _child)


def _child(job: dict[str, Any]) -> None:
    """A forked child: leave the zygote's pipes, run the job, never return."""
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        import support.crash_worker as crash_worker

        crash_worker.main(job)
    finally:
        os._exit(70)


class Zygote:
    """The driver's side of the zygote: start it, fork children, learn their exits."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.runs = 0
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import support.crash_harness as h; h.serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(workdir / "zygote.log", "w"),  # noqa: SIM115  (lives as long as it)
            env=env,
            text=True,
        )
        self.children: dict[int, dict[str, Any]] = {}
        self.changed = threading.Condition()
        self.dead = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self.changed:
                self.children.setdefault(message["id"], {}).update(message)
                self.changed.notify_all()
        with self.changed:  # the zygote is gone: nobody waits for an answer in vain
            self.dead = True
            self.changed.notify_all()

    def start(self, job: dict[str, Any]) -> Child:
        """Fork a child that runs ``job`` (see ``crash_worker``); this process's state
        directory and S3 settings go with it (the zygote's are from its start)."""
        self.runs += 1
        base = self.workdir / f"run{self.runs:05d}"
        job = {
            **job,
            "id": self.runs,
            "events": f"{base}.events",
            "log": f"{base}.log",
            "env": {k: os.environ[k] for k in _ENV if k in os.environ},
        }
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        info = self._wait(job["id"], "pid", 60)
        return Child(self, job["id"], info["pid"], Path(job["events"]), Path(job["log"]))

    def _wait(self, job_id: int, key: str, timeout: float) -> dict[str, Any]:
        with self.changed:
            self.changed.wait_for(
                lambda: self.dead or key in self.children.get(job_id, {}), timeout
            )
            info = self.children.get(job_id, {})
        if key not in info and self.dead:
            log = (self.workdir / "zygote.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the zygote exited: {log}")
        if key not in info:
            raise TimeoutError(f"zygote: no {key} for run {job_id} within {timeout} s")
        return info

    def exit_code(self, job_id: int) -> int | None:
        with self.changed:
            return self.children.get(job_id, {}).get("exit")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)


@dataclass
class Child:
    zygote: Zygote
    job_id: int
    pid: int
    events_path: Path
    log_path: Path
    seen: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0

    def alive(self) -> bool:
        return self.zygote.exit_code(self.job_id) is None

    def events(self) -> list[dict[str, Any]]:
        """Every complete event line written so far (a partial last line is left)."""
        try:
            with open(self.events_path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return self.seen
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        self.seen.extend(json.loads(line) for line in complete.splitlines() if line)
        return self.seen

    def wait_for(self, kind: str, timeout: float) -> dict[str, Any] | None:
        """The first event of ``kind``; None if the child ended (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = self.alive()
            for event in self.events():
                if event["e"] == kind:
                    return event
            if not alive or time.monotonic() > deadline:
                return None
            time.sleep(0.005)

    def send_kill(self) -> None:
        """SIGKILL the child (if it still runs); returns at once."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(self.pid, signal.SIGKILL)

    def kill(self) -> int | None:
        """SIGKILL the child; its exit status once the zygote reaped it."""
        self.send_kill()
        return self.join(30)

    def join(self, timeout: float) -> int | None:
        """Wait for the child's exit (killing it after ``timeout``): its exit status."""
        try:
            self.zygote._wait(self.job_id, "exit", timeout)
        except TimeoutError:
            return self.kill()
        self.events()
        return self.zygote.exit_code(self.job_id)

    def steps(self, kind: str) -> list[int]:
        return [e["step"] for e in self.events() if e["e"] == kind]

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""


@dataclass
class Tally:
    """One scenario's figures."""

    scenario: str
    seed: int
    kills: int = 0
    restores: int = 0
    mid_operation: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, trial: int, what: str) -> None:
        self.failures.append(f"kill {trial} (seed {self.seed}): {what}")

    def recovered(self, restored: int, completed: int) -> None:
        """Count how the recovered step compares with the last completed save."""
        if restored == completed:
            self.outcomes["recovered = last completed"] += 1
        elif restored > completed:
            self.outcomes[f"recovered {restored - completed} newer"] += 1

    def detail(self) -> str:
        outcomes = ", ".join(f"{n} {what}" for what, n in sorted(self.outcomes.items()))
        return (
            f"seed {self.seed}; {self.kills} kills, {self.restores} restores, "
            f"{self.mid_operation} mid-operation; {outcomes}"
        )


def check_events(child: Child, tally: Tally, trial: int, completed: int, newest: int) -> int:
    """Judge a fresh process's restore from ``child``'s events (a ``check`` child's, or a
    restarted trainer's that verified); the newest step known to be published.

    It must have restored at least ``completed`` (the last save that completed, or
    that a restore already saw) and at most ``newest`` (the newest step any save
    began), bit-exactly and without skipping anything; each tier restored alone must
    hold an exact state of a step that was saved; ``verify --all`` must pass on every
    tier, and ``audit verify`` on the audit log of a run with trust features.
    """
    events = child.events()
    restored = next((e for e in events if e["e"] == "restored"), None)
    if restored is None:
        tally.fail(trial, f"no restore reported: {events[-2:]}")
        return completed
    tally.restores += 1
    step = restored["step"]
    if not completed <= step <= newest:
        tally.fail(trial, f"restored step {step}, expected {completed}..{newest}")
    for event in events:
        where = event.get("location")
        if event["e"] in ("restored", "restored-tier") and (event["wrong"] or event["skipped"]):
            tally.fail(trial, f"{where}: step {event['step']} restored with {event}")
        if event["e"] == "restored-tier" and event["step"] > newest:
            tally.fail(trial, f"{where}: step {event['step']} was never saved")
        if event["e"] == "tier" and event["verify"] != 0:
            tally.fail(trial, f"verify --all failed on {where}: {child.log()}")
        if event["e"] == "audit" and event["rc"] != 0:
            tally.fail(trial, f"audit verify failed: {child.log()}")
    tally.recovered(step, completed)
    return max(step, completed)


def check_restore(
    zygote: Zygote, job: dict[str, Any], tally: Tally, trial: int, completed: int, newest: int
) -> tuple[int, Child]:
    """Run a fresh ``check`` child and judge it (:func:`check_events`): the newest
    step known to be published, and the child."""
    child = zygote.start({**job, "mode": "check"})
    code = child.join(120)
    if code != 0:
        tally.fail(trial, f"check exited {code}: {child.events()[-2:]} {child.log()}")
        return completed, child
    return check_events(child, tally, trial, completed, newest), child
