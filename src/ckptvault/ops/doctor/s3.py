"""``ckptvault doctor`` for an ``s3://`` store: the bucket's protections and the
credentials in use (seed 000: block public access, keep versions, lock objects,
encrypt at rest, scope tokens to hours rather than years)."""

from __future__ import annotations

from typing import Any

from ckptvault.ops.doctor.findings import FAIL, OK, SKIP, WARN, Finding
from ckptvault.storage.base import Store
from ckptvault.storage.s3.client import S3Error

PUBLIC_ACCESS_FLAGS = (
    "BlockPublicAcls",
    "IgnorePublicAcls",
    "BlockPublicPolicy",
    "RestrictPublicBuckets",
)


def check_s3(store: Store) -> list[Finding]:
    client = getattr(store, "client", None)
    if client is None:
        return [Finding("bucket", SKIP, f"{store.location}: not a store doctor can inspect")]
    return [
        _public_access(client),
        _versioning(client),
        _object_lock(client),
        _encryption(client),
        _credentials(),
    ]


def _ask(client: Any, operation: str) -> dict[str, Any] | S3Error:
    try:
        return client.call(operation)
    except S3Error as exc:
        return exc


def _cannot(check: str, exc: S3Error, permission: str) -> Finding:
    return Finding(
        check,
        SKIP,
        f"cannot read it: {exc}",
        f"grant s3:{permission} to the checking identity to check it",
    )


def _public_access(client: Any) -> Finding:
    check = "bucket public access block"
    answer = _ask(client, "get_public_access_block")
    fix = (
        f"aws s3api put-public-access-block --bucket {client.bucket} "
        "--public-access-block-configuration BlockPublicAcls=true,IgnorePublicAcls=true,"
        "BlockPublicPolicy=true,RestrictPublicBuckets=true"
    )
    if isinstance(answer, S3Error):
        if answer.code == "NoSuchPublicAccessBlockConfiguration":
            return Finding(check, FAIL, f"s3://{client.bucket} has no public access block", fix)
        return _cannot(check, answer, "GetBucketPublicAccessBlock")
    settings = answer.get("PublicAccessBlockConfiguration", {})
    off = [flag for flag in PUBLIC_ACCESS_FLAGS if not settings.get(flag)]
    if off:
        return Finding(check, FAIL, f"off: {', '.join(off)}", fix)
    return Finding(check, OK, "all four public access settings are on")


def _versioning(client: Any) -> Finding:
    check = "bucket versioning"
    answer = _ask(client, "get_bucket_versioning")
    if isinstance(answer, S3Error):
        return _cannot(check, answer, "GetBucketVersioning")
    status = answer.get("Status", "never enabled")
    if status == "Enabled":
        return Finding(check, OK, "enabled: an overwritten or deleted object can be recovered")
    return Finding(
        check,
        WARN,
        f"versioning is {status.lower()}: a deleted or overwritten generation is gone",
        f"aws s3api put-bucket-versioning --bucket {client.bucket} "
        "--versioning-configuration Status=Enabled (and a lifecycle rule for old versions)",
    )


def _object_lock(client: Any) -> Finding:
    check = "bucket object lock"
    answer = _ask(client, "get_object_lock_configuration")
    if isinstance(answer, S3Error):
        if answer.code == "ObjectLockConfigurationNotFoundError":
            answer = {}
        else:
            return _cannot(check, answer, "GetBucketObjectLockConfiguration")
    settings = answer.get("ObjectLockConfiguration", {})
    if settings.get("ObjectLockEnabled") == "Enabled":
        return Finding(
            check,
            OK,
            "enabled: ckptvault can lock generations (object_lock_days=) against deletion",
        )
    return Finding(
        check,
        WARN,
        "object lock is off: stolen write credentials can delete every generation",
        "create the bucket with object lock (it cannot be turned on later everywhere) and "
        "save with object_lock_days=",
    )


def _encryption(client: Any) -> Finding:
    check = "bucket default encryption"
    answer = _ask(client, "get_bucket_encryption")
    if isinstance(answer, S3Error):
        if answer.code == "ServerSideEncryptionConfigurationNotFoundError":
            return Finding(
                check,
                WARN,
                "no default encryption at rest",
                f"aws s3api put-bucket-encryption --bucket {client.bucket} ... (SSE-KMS), "
                "or encrypt in ckptvault (keystore=) so the bucket only sees ciphertext",
            )
        return _cannot(check, answer, "GetEncryptionConfiguration")
    rules = answer.get("ServerSideEncryptionConfiguration", {}).get("Rules", [])
    kinds = sorted(
        {r.get("ApplyServerSideEncryptionByDefault", {}).get("SSEAlgorithm", "?") for r in rules}
    )
    return Finding(check, OK, f"default encryption: {', '.join(kinds) or 'configured'}")


def _credentials() -> Finding:
    """Long-lived keys (an IAM user's ``AKIA...``, or any static key without a session
    token) are the ones that leak and stay valid for years."""
    check = "S3 credentials"
    try:
        import boto3

        credentials = boto3.session.Session().get_credentials()
    except Exception as exc:  # botocore raises many kinds while resolving a profile
        return Finding(check, SKIP, f"cannot resolve them: {type(exc).__name__}: {exc}")
    if credentials is None:
        return Finding(check, SKIP, "no credentials found")
    frozen = credentials.get_frozen_credentials()
    source = getattr(credentials, "method", "unknown source")
    if frozen.token:
        return Finding(check, OK, f"temporary (session token; from {source})")
    return Finding(
        check,
        WARN,
        f"long-lived static keys (no session token; from {source}): valid until someone "
        "revokes them",
        "use a role (instance profile, IRSA, web identity) or STS tokens that expire in hours",
    )
