"""Azurite, Microsoft's Azure Storage emulator, on loopback for the tests.

``make test`` installs the ``azurite`` npm package into the repository's ``.node/``
folder; the session fixture starts its blob service (``azurite-blob``) as a child
process on a free port of 127.0.0.1, with its data in a temporary directory of its
own, waits until the service answers a container listing, and stops it by its own
process group when the session ends. Each pytest-xdist worker runs its own.

Tests reach it through a connection string for Azurite's well-known development
account, exactly as a user's ``AZURE_STORAGE_CONNECTION_STRING`` would; the
``azure_env`` fixture sets that variable for one test (and so for every subprocess
it starts). Each test makes its own containers, so tests never see each other's blobs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
AZURITE_BLOB = REPO / ".node" / "node_modules" / ".bin" / "azurite-blob"
ENV_VAR = "AZURE_STORAGE_CONNECTION_STRING"

# Azurite's fixed development account (public, documented by Microsoft: it is no secret).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

# A cold start here takes 1-2 s; a loaded 2-core machine running two pytest workers and
# their subprocesses can take many times that.
_START_TIMEOUT = 60.0
# Azurite answers SIGTERM by waiting for idle keep-alive connections to close (up to
# two minutes, seen here); its data is a temporary directory, so it gets 2 s.
_STOP_TIMEOUT = 2.0


def connection_string(port: int) -> str:
    """The connection string of Azurite's development account on ``127.0.0.1:port``."""
    return (
        "DefaultEndpointsProtocol=http;"
        f"AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
    )


def service_client(conn_str: str) -> Any:
    """A plain ``BlobServiceClient`` for test set-up and inspection (not ckptvault's)."""
    from azure.storage.blob import BlobServiceClient

    # The SDK logs every request's headers at INFO (pytest shows them with a failure).
    logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)
    return BlobServiceClient.from_connection_string(conn_str)


def new_container(conn_str: str) -> str:
    """A fresh, empty container with a unique name (3-63 characters: lowercase letters,
    digits and hyphens, as Azure requires)."""
    name = f"ckv-{secrets.token_hex(8)}"
    service_client(conn_str).create_container(name)
    return name


def _azurite_binary() -> Path:
    if AZURITE_BLOB.exists():
        return AZURITE_BLOB
    found = shutil.which("azurite-blob")
    if found:
        return Path(found)
    pytest.fail(
        f"the Azure tests need Azurite's blob service, and {AZURITE_BLOB} is missing "
        "(nor is azurite-blob on PATH): run `make test`, which installs it with npm "
        "(npm install --prefix .node azurite@3.37.0)",
        pytrace=False,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(log: Path, lines: int = 30) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {log}: {exc})"
    return "\n".join(text.splitlines()[-lines:]) or "(the log is empty)"


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the test process dies, so a
    killed pytest (SIGKILL skips every teardown) leaves no emulator running."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Azurite:
    """One ``azurite-blob`` child process: its port, data directory, log and group."""

    def __init__(self, binary: Path, workdir: Path) -> None:
        self.port = _free_port()
        self.data = workdir / "data"
        self.data.mkdir()
        self.log = workdir / "azurite.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    str(binary),
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    str(self.port),
                    "--location",
                    str(self.data),
                    # The SDK speaks a newer service version than the emulator knows.
                    "--skipApiVersionCheck",
                    # No outbound calls from a test run, and no access log per request.
                    "--disableTelemetry",
                    "--silent",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                start_new_session=True,  # its own process group, stopped as one
                preexec_fn=_die_with_parent,
            )
        self.conn_str = connection_string(self.port)

    def wait_ready(self, *, last: bool = True, timeout: float = _START_TIMEOUT) -> float | None:
        """Wait until the service lists containers; return the seconds that took.
        Fails the session with the log's tail if it does not answer in time, or if it
        exits while starting (unless this is not the ``last`` attempt: then None)."""
        from azure.core.exceptions import AzureError

        started = time.monotonic()
        client = service_client(self.conn_str)
        error: BaseException | None = None
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                if not last and "EADDRINUSE" in _tail(self.log):
                    return None
                pytest.fail(
                    f"Azurite (pid {self.process.pid}, port {self.port}) exited with "
                    f"status {self.process.returncode} while starting; its log ends:\n{_tail(self.log)}",
                    pytrace=False,
                )
            if f"listens on http://127.0.0.1:{self.port}" not in _tail(self.log):
                # Until our process says it holds the port, whatever answers there
                # (another test run's emulator) is not ours.
                time.sleep(0.05)
                continue
            try:
                list(client.list_containers(retry_total=0, connection_timeout=2, read_timeout=2))
                return time.monotonic() - started
            except AzureError as exc:
                error = exc
                time.sleep(0.05)
        self.stop()
        pytest.fail(
            f"Azurite (pid {self.process.pid}, port {self.port}) did not list containers "
            f"within {timeout:.0f} s (last error: {error!r}); its log ends:\n{_tail(self.log)}",
            pytrace=False,
        )

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL if it is still there after a while."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(_STOP_TIMEOUT)


@pytest.fixture(scope="session")
def azurite_endpoint() -> Iterator[str]:
    """The connection string of a session-wide Azurite blob service on loopback."""
    try:
        import azure.storage.blob  # noqa: F401
    except ImportError as exc:
        pytest.fail(
            f"the Azure tests need azure-storage-blob ({exc}): run `make test`, which "
            "installs ckptvault[dev] (it includes the azure extra)",
            pytrace=False,
        )
    binary = _azurite_binary()
    with tempfile.TemporaryDirectory(prefix="ckv-azurite-") as workdir:
        server = _start(binary, Path(workdir))
        try:
            yield server.conn_str
        finally:
            server.stop()


def _start(binary: Path, workdir: Path, attempts: int = 3) -> Azurite:
    """A started, answering Azurite. The free port is found before Azurite binds it,
    so another process may take it in between: then Azurite exits, and a new port is
    tried (each attempt in its own directory)."""
    for attempt in range(attempts):
        attempt_dir = workdir / f"attempt-{attempt}"
        attempt_dir.mkdir()
        server = Azurite(binary, attempt_dir)
        if server.wait_ready(last=attempt == attempts - 1) is not None:
            return server
    raise AssertionError("unreachable: the last attempt fails the session")


@pytest.fixture
def azure_env(azurite_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``AZURE_STORAGE_CONNECTION_STRING`` set to Azurite for this test (and the
    subprocesses it starts); returns the connection string."""
    monkeypatch.setenv(ENV_VAR, azurite_endpoint)
    return azurite_endpoint


@pytest.fixture
def azure_container(azure_env: str) -> str:
    """A fresh container on Azurite, with the environment pointing at it."""
    return new_container(azure_env)
