"""A real S3-protocol server on loopback for the tests (moto's ThreadedMotoServer).

The server runs in the test process, on a free port of 127.0.0.1, for the whole
session; subprocesses reach it through the environment the session fixture sets
(fake credentials, ``AWS_ENDPOINT_URL``), exactly as a user's boto3 configuration
would. Each test gets its own fresh bucket, so tests never see each other's objects.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

# The fake credentials every S3 test uses (SeaweedFS starts with them as its identity).
ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "ckptvault-test",
    "AWS_SECRET_ACCESS_KEY": "ckptvault-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never ask a metadata service for credentials
    "AWS_CONFIG_FILE": os.devnull,  # never read the developer's profiles
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


class _Server:
    """The session's one server, started on first use."""

    endpoint: str | None = None
    _moto: Any = None

    @classmethod
    def start(cls) -> str:
        if cls.endpoint is None:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            cls._moto, cls.endpoint = server, f"http://{host}:{port}"
        return cls.endpoint


def s3_client(endpoint: str) -> Any:
    """A plain boto3 client for test set-up and inspection (not ckptvault's)."""
    from ckptvault.aws import boto3_session

    return boto3_session().client("s3", endpoint_url=endpoint)


def new_bucket(endpoint: str, *, object_lock: bool = False) -> str:
    """A fresh, empty bucket with a unique name."""
    name = f"ckv-{secrets.token_hex(8)}"
    params = {"ObjectLockEnabledForBucket": True} if object_lock else {}
    s3_client(endpoint).create_bucket(Bucket=name, **params)
    return name


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The loopback S3 endpoint, with fake credentials and ``AWS_ENDPOINT_URL`` set
    in this process's environment (and so in every subprocess it starts)."""
    pytest.importorskip("boto3", reason="the S3 tests need ckptvault[s3]")
    pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (ckptvault[dev])")
    endpoint = _Server.start()
    saved = {name: os.environ.get(name) for name in [*ENVIRONMENT, "AWS_ENDPOINT_URL"]}
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        saved[name] = os.environ.pop(name, None)
    os.environ.update(ENVIRONMENT, AWS_ENDPOINT_URL=endpoint)
    yield endpoint
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket on the loopback server."""
    return new_bucket(s3_endpoint)
