"""Start worker scripts as forked children of a process that imported torch once.

A Python process that imports torch, DCP and ckptvault costs 2.5 s of CPU here; a
multi-rank test starts 2 to 4 of them, and the suite several hundred. The fork
server imports all of that once (per pytest worker) and then only forks: each job is
a child that runs a script as ``__main__`` with its own argv, environment, working
directory and log file, exactly as ``python script.py args`` would, minus the
imports. The server never runs a torch op, so no thread pool exists when it forks
(the crash harness's zygote, ``crash_harness.py``, does the same for its kills).

A child is a real process: it has its own pid, can be SIGKILLed, and its exit status
is what ``Popen.returncode`` would be. It ends as the interpreter's shutdown would in
everything a test observes: an uncaught exception's traceback on stderr, non-daemon
threads joined, atexit handlers run (tempfile's and ``weakref.finalize``'s cleanups
among them), stdout and stderr flushed. It skips the teardown of modules and the
final collections, which walk, and so copy page by page, the whole heap it inherited
(1.4 s of a forked rank's 1.7 s here; the server also freezes what it imported).
What a child shares with its siblings is what a fresh interpreter would compute
alike anyway (imported modules) and the hash seed. Tests that are about a fresh
interpreter (import cost, exit codes of the CLI, resume in a new process, what
happens at teardown) start ``python`` themselves (``launch(fresh=True)``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What rank workers import before their first collective (torch._dynamo alone, pulled
# in by the first optimizer step, takes a second here).
PRELOAD = (
    "torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict", "torch.distributed.tensor",
    "torch.distributed.device_mesh", "torch.distributed.fsdp", "torch.nn.parallel",
    "numpy", "boto3", "ckptvault", "ckptvault.manager", "ckptvault.dcp",
    "ckptvault.distributed.coordinator", "ckptvault.storage.s3.store",
    "support.common",
)  # fmt: skip
TESTS = Path(__file__).resolve().parents[1]


def fork_loop(preload: tuple[str, ...], child: Callable[[dict[str, Any]], None]) -> None:
    """A fork server's loop: import ``preload``, then fork one child per job line on
    stdin, in which ``child(job)`` runs and never returns; write ``{"id", "pid"}``
    when forked and ``{"id", "exit"}`` when reaped (``exit`` as ``Popen.returncode``:
    ``-9`` for SIGKILL). EOF: SIGKILL every child still running and exit (no child
    outlives its driver, no slow teardown). The crash harness's zygote runs it too."""
    import gc
    import importlib

    for name in preload:
        with contextlib.suppress(ImportError):  # an extra not installed: its tests skip
            importlib.import_module(name)
    # What the children inherit goes to the collector's permanent generation: a child
    # that exits would otherwise walk (and so copy, page by page) the whole inherited
    # heap in its final collections, 1.4 s of a forked rank's exit here; 0.4 s frozen.
    gc.collect()
    gc.freeze()
    children: dict[int, int] = {}  # pid -> job id
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    pending = b""
    while True:
        if selector.select(timeout=0.005):
            data = os.read(0, 1 << 16)
            if not data:
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os._exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                job = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    child(job)
                children[pid] = job["id"]
                _reply({"id": job["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _reply({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})


def serve() -> None:
    """This fork server: rank workers and other scripts, run as ``__main__``."""
    fork_loop(PRELOAD, _run)


def _reply(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _run(job: dict[str, Any]) -> None:
    """In the child: become ``python script args`` with the job's environment."""
    import runpy

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the server's job pipe stays the server's
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    if "numpy" in sys.modules:  # random reseeds itself after a fork; numpy does not
        sys.modules["numpy"].random.seed()
    threads = job["env"].get("OMP_NUM_THREADS")
    if threads:  # read by OpenMP when torch loaded, so set here as a fresh process would
        import torch

        torch.set_num_threads(int(threads))
    script = job["script"]
    sys.argv = [script, *job["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    # SystemExit and uncaught exceptions end the child as the interpreter would: exit
    # status, traceback on stderr, threads joined, atexit handlers, streams flushed.
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what Py_FinalizeEx does first: join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class ForkServer:
    """The test's side: start the server, fork jobs, learn their exit statuses."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="ckptvault-forkserver-"))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import support.forkserver as f; f.serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.workdir / "server.log", "w"),  # noqa: SIM115  (lives as long as it)
            env=env,
            text=True,
        )
        self.jobs = 0
        self.replies: dict[int, dict[str, Any]] = {}
        self.changed = threading.Condition()
        self.dead = False
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self.changed:
                self.replies.setdefault(message["id"], {}).update(message)
                self.changed.notify_all()
        with self.changed:
            self.dead = True
            self.changed.notify_all()

    def start(
        self, script: str | Path, argv: list[str], env: dict[str, str], log: Path
    ) -> Forked:
        """Fork a child running ``script argv`` with exactly ``env`` (as Popen's env=),
        this process's working directory, stdout and stderr to ``log``."""
        with self.lock:
            self.jobs += 1
            job_id = self.jobs
            job = {
                "id": job_id,
                "script": str(script),
                "argv": [str(a) for a in argv],
                "env": env,
                "cwd": os.getcwd(),
                "log": str(log),
            }
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
        pid = self._wait(job_id, "pid", 60)["pid"]
        return Forked(self, job_id, pid)

    def _wait(self, job_id: int, key: str, timeout: float | None) -> dict[str, Any]:
        with self.changed:
            self.changed.wait_for(
                lambda: self.dead or key in self.replies.get(job_id, {}), timeout
            )
            info = dict(self.replies.get(job_id, {}))
        if key in info:
            return info
        if self.dead:
            log = (self.workdir / "server.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the fork server exited: {log}")
        raise subprocess.TimeoutExpired(f"forked job {job_id}", timeout or 0)

    def close(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)


class Forked:
    """A forked child, with the part of ``Popen``'s interface the launchers use."""

    def __init__(self, server: ForkServer, job_id: int, pid: int) -> None:
        self.server, self.job_id, self.pid = server, job_id, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self.server.changed:
            self.returncode = self.server.replies.get(self.job_id, {}).get("exit")
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = int(self.server._wait(self.job_id, "exit", timeout)["exit"])
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


_server: ForkServer | None = None


def server() -> ForkServer:
    """This process's fork server, started on first use and stopped at exit."""
    global _server
    if _server is None or _server.dead:
        _server = ForkServer()
        atexit.register(_server.close)
    return _server
