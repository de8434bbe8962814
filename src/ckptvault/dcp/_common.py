"""What the DCP storage plugin's writer and reader share: options, the job's
coordinator, and errors that survive DCP's trip between ranks.

DCP runs every plugin method inside its own error handling: an exception raised on
any rank is pickled (by DCP) to the coordinator and re-raised on every rank inside a
``torch.distributed.checkpoint.api.CheckpointException``. So errors raised here are
always of a kind whose only constructor argument is the message (they survive that
trip), and :mod:`ckptvault.dcp._typed` turns DCP's wrapper back into ckptvault's own
error.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ckptvault.coordinator import Coordinator, SingleProcess
from ckptvault.errors import FormatError, IntegrityError, UnsupportedValueError, UsageError
from ckptvault.storage import open_store
from ckptvault.storage.base import Store
from ckptvault.storage.s3.options import S3Options
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.keystores import open_keystore
from ckptvault.trust.problems import GenerationRejected
from ckptvault.trust.signing import PrivateKeyLike, PublicKeyLike, TrustedKeys, load_private_key

__all__ = ["job_coordinator", "open_plugin_store", "plugin_trust", "portable"]

StoreURL = str | os.PathLike[str]
KeystoreLike = str | os.PathLike[str] | KeyStore


def check_run_id(run_id: Any) -> str:
    """``run_id`` is required: the signature, the run's key and every reader's run
    check are bound to it, so a default (a directory name) would not be unique."""
    if not isinstance(run_id, str) or not run_id or len(run_id) > 256:
        raise UsageError(
            f"run_id must be a non-empty string of at most 256 characters naming this run "
            f"uniquely, got {run_id!r}"
        )
    return run_id


def open_plugin_store(url: StoreURL, s3_endpoint_url: str | None, *, must_exist: bool) -> Store:
    """The store at ``url`` (path, ``file://``, ``s3://`` or ``az://``); ``s3_endpoint_url`` only
    for ``s3://`` stores (``UsageError`` otherwise)."""
    options = S3Options(endpoint_url=s3_endpoint_url) if s3_endpoint_url is not None else None
    return open_store(url, must_exist=must_exist, s3=options)


def plugin_trust(
    store: Store,
    *,
    signing_key: PrivateKeyLike | None = None,
    trusted_keys: Iterable[PublicKeyLike] | PublicKeyLike | None = None,
    keystore: KeystoreLike | None = None,
    ledger: StoreURL | None = None,
    audit_log: StoreURL | None = None,
) -> TrustContext:
    """The plugin's trust context. Without ``ledger``: keys only (no rollback floor,
    no published table, no audit log; ``audit_log`` alone is refused). With it:
    the manager's own control plane (``TrustContext.configure``), so the plugin keeps
    and checks the same floor and published table, and audits into ``audit_log``
    (default: beside the ledger). Neither may live inside ``store``."""
    if ledger is not None:
        trust = TrustContext.configure(
            signing_key=signing_key,
            trusted_keys=trusted_keys,
            keystore=keystore,
            ledger=ledger,
            audit_log=audit_log,
        )
        trust.check_outside(store)
        return trust
    if audit_log is not None:
        raise UsageError(
            "audit_log= needs ledger=: the ledger keeps the audit log's head (without it "
            "a cut-off log could not be told from a whole one)"
        )
    trusted = None
    if trusted_keys is not None:
        single = (str, bytes, os.PathLike, Ed25519PublicKey, Ed25519PrivateKey)
        if isinstance(trusted_keys, single):
            trusted = TrustedKeys.load([trusted_keys])  # one key given alone
        else:
            trusted = TrustedKeys.load(trusted_keys)
    trust = TrustContext(
        signer=load_private_key(signing_key) if signing_key is not None else None,
        trusted=trusted,
        keystore=open_keystore(keystore) if keystore is not None else None,
    )
    trust.check_outside(store)
    return trust


# -- the job -----------------------------------------------------------------------------

_shared: tuple[Any, Coordinator] | None = None


def job_coordinator(timeout_s: float) -> Coordinator:
    """This process's place in the job: one process alone, or a torch.distributed job
    (collectives as JSON on a gloo group of ckptvault's own, never pickled).

    The group is made once per default process group and reused, because making one
    is itself a collective: every rank must reach the first call together (every
    rank constructs the reader). ``timeout_s`` of that first call applies throughout.
    """
    global _shared
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SingleProcess()
    world = dist.group.WORLD
    if _shared is None or _shared[0] is not world:
        from ckptvault.distributed.coordinator import TorchDistributed

        _shared = (world, TorchDistributed(timeout_s))
    return _shared[1]


# -- errors ------------------------------------------------------------------------------


def portable(exc: BaseException) -> BaseException:
    """An equivalent of ``exc`` that DCP can carry between ranks: ckptvault errors
    whose constructor takes more than a message become their message-only kin."""
    if isinstance(exc, GenerationRejected):
        return IntegrityError(str(exc))
    if isinstance(exc, UnsupportedValueError):
        return FormatError(str(exc))
    return exc
