"""``ckptvault doctor`` for an ``az://`` store: the container's and account's
protections and the credentials in use (seed 000: no public access, keep deleted and
overwritten data recoverable, lock what must stay, scope tokens to hours).

Every check reads; none writes. Versioning is a setting of the account that a
data-plane client cannot read, so it is told from the store's own blobs: a listing
with versions shows version ids only where versioning is on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from ckptvault.ops.doctor.findings import FAIL, OK, SKIP, WARN, Finding
from ckptvault.storage.azure.client import CONNECTION_STRING, AzureClient, AzureError
from ckptvault.storage.azure.store import AzureStore

T = TypeVar("T")


def check_azure(store: AzureStore) -> list[Finding]:
    client = store.client
    return [
        _public_access(client),
        _soft_delete(client),
        _versioning(client, store.layout.generations_prefix),
        _immutability(client),
        _credentials(),
    ]


def _ask(client: AzureClient, what: str, operation: Callable[[], T]) -> T | AzureError:
    try:
        return client.call(what, operation)
    except AzureError as exc:
        return exc


def _cannot(check: str, exc: AzureError, role: str) -> Finding:
    return Finding(
        check, SKIP, f"cannot read it: {exc}", f"grant the checking identity {role} to check it"
    )


def _public_access(client: AzureClient) -> Finding:
    check = "container public access"
    answer = _ask(client, "reading the access policy", client.raw.get_container_access_policy)
    if isinstance(answer, AzureError):
        return _cannot(check, answer, "read access to the container's ACL")
    level = answer.get("public_access")
    if level:
        return Finding(
            check,
            FAIL,
            f"az://{client.container} allows anonymous {level} reads: anyone can download "
            "every checkpoint",
            f"az storage container set-permission --name {client.container} --public-access off "
            "(and set allowBlobPublicAccess=false on the account)",
        )
    return Finding(check, OK, "no anonymous access")


def _soft_delete(client: AzureClient) -> Finding:
    check = "blob soft delete"
    answer = _ask(client, "reading the service properties", client.service.get_service_properties)
    if isinstance(answer, AzureError):
        return _cannot(check, answer, "Storage Account Contributor (service properties)")
    policy = answer.get("delete_retention_policy")
    if policy is not None and getattr(policy, "enabled", False):
        return Finding(
            check, OK, f"on: deleted blobs are recoverable for {getattr(policy, 'days', '?')} days"
        )
    return Finding(
        check,
        WARN,
        "off: a deleted generation (gc, or stolen credentials) is gone at once",
        "az storage account blob-service-properties update --account-name ACCOUNT "
        "--enable-delete-retention true --delete-retention-days 7",
    )


def _versioning(client: AzureClient, prefix: str) -> Finding:
    check = "blob versioning"
    try:
        listed = []
        for item in client.list_blobs(prefix, versions=True):
            listed.append(item)
            if len(listed) >= 50:
                break
    except AzureError as exc:
        return _cannot(check, exc, "Storage Blob Data Reader")
    if not listed:
        return Finding(check, SKIP, "the store holds no blobs yet to tell from")
    if any(item.version_id for item in listed):
        return Finding(check, OK, "on: an overwritten or deleted blob can be recovered")
    return Finding(
        check,
        WARN,
        "off: an overwritten or deleted generation is gone",
        "az storage account blob-service-properties update --account-name ACCOUNT "
        "--enable-versioning true (and a lifecycle rule for old versions)",
    )


def _immutability(client: AzureClient) -> Finding:
    check = "version-level immutability"
    answer: Any = _ask(client, "reading the container", client.raw.get_container_properties)
    if isinstance(answer, AzureError):
        return _cannot(check, answer, "Storage Blob Data Reader")
    if getattr(answer, "immutable_storage_with_versioning_enabled", False):
        return Finding(
            check,
            OK,
            "supported: ckptvault can lock generations (object_lock_days=) against deletion",
        )
    return Finding(
        check,
        WARN,
        "off: stolen write credentials can delete every generation",
        "use a container with version-level immutability support (az storage container-rm "
        "create --enable-vlw) and save with object_lock_days=",
    )


def _credentials() -> Finding:
    """An account key is the account's root secret: it never expires and grants
    everything; a SAS with an expiry or an Entra ID token is scoped and short."""
    check = "Azure credentials"
    text = os.environ.get(CONNECTION_STRING)
    if not text:
        return Finding(check, OK, "Entra ID (DefaultAzureCredential): tokens that expire in hours")
    fields = dict(part.split("=", 1) for part in text.split(";") if "=" in part)
    if "AccountKey" in fields:
        return Finding(
            check,
            WARN,
            f"an account key ({CONNECTION_STRING}): full control of the account, valid until "
            "someone rotates it",
            "use a user delegation SAS with an expiry, or Entra ID (unset the connection string "
            "and set AZURE_STORAGE_ACCOUNT_URL)",
        )
    if "SharedAccessSignature" in fields:
        return Finding(check, OK, "a shared access signature (check its expiry, se=)")
    return Finding(check, SKIP, "the connection string holds neither a key nor a SAS")
