"""What ckptvault writes into KMS: alias names, key tags and encryption context.

These names are a contract beyond this process: IAM conditions and CloudTrail see
the encryption context, KMS administrators see the tags, and a key store opened
later (by another version, on another machine) finds a run's key by its alias and
trusts it by its ``ckptvault:run-hash`` tag. Changing any of them cuts existing
runs off from their keys or their tombstones. The meaning of each is in
:mod:`ckptvault.trust.kms.keystore`.
"""

from __future__ import annotations

import base64
import json
import re

from blake3 import blake3

from ckptvault.format.layout import utc_now as _now

DEFAULT_ALIAS_PREFIX = "alias/ckptvault/"
TOMBSTONES = "tombstones"

TAG_RUN_HASH = "ckptvault:run-hash"
TAG_RUN_ID = "ckptvault:run-id"
TAG_CREATED = "ckptvault:created-at"
TAG_DESTROYED = "ckptvault:destroyed-at"
TAG_ROTATED_FROM = "ckptvault:rotated-from"
TAG_ROTATING_TO = "ckptvault:rotating-to"
TAG_RETIRED = "ckptvault:retired-at"
TAG_ROLE = "ckptvault:role"

CONTEXT_RUN = "ckptvault:run"
CONTEXT_BINDING = "ckptvault:binding"
CONTEXT_PURPOSE = "ckptvault:purpose"
PURPOSE = "key-wrap v1"

ALIAS_PREFIX_RE = re.compile(r"^alias/[A-Za-z0-9/_-]{0,200}/\Z")
# What ckptvault records as a KEK id: the key's ARN, as Encrypt returns it.
KEY_ARN_RE = re.compile(r"^arn:aws[a-z-]*:kms:[a-z0-9-]{1,32}:[0-9]{12}:key/[A-Za-z0-9-]{1,128}\Z")
_UNREADABLE_ALIAS_CHARS = re.compile(r"[^A-Za-z0-9_-]")
_MAX_TAG_VALUE = 256


def run_hash(run_id: str) -> str:
    return blake3(run_id.encode("utf-8")).hexdigest()


def run_key_name(run_id: str) -> str:
    """``<readable run id>-<hash>``: alias characters only, unique per run id."""
    readable = _UNREADABLE_ALIAS_CHARS.sub("_", run_id)[:64]
    return f"{readable}-{run_hash(run_id)[:20]}"


def wrapping_context(run_id: str, context: bytes) -> dict[str, str]:
    """The KMS encryption context of one wrapped key."""
    return {
        CONTEXT_RUN: run_id,
        CONTEXT_BINDING: base64.b64encode(context).decode("ascii"),
        CONTEXT_PURPOSE: PURPOSE,
    }


def run_tags(run_id: str, **extra: str) -> list[dict[str, str]]:
    """The tags of a new key of ``run_id`` (plus ``extra``), as CreateKey takes them."""
    tags = {TAG_RUN_HASH: run_hash(run_id), TAG_CREATED: _now(), **extra}
    encoded = base64.b64encode(run_id.encode("utf-8")).decode("ascii")
    if len(encoded) <= _MAX_TAG_VALUE:
        tags[TAG_RUN_ID] = encoded
    return [{"TagKey": key, "TagValue": value} for key, value in tags.items()]


def run_key_description(run_id: str) -> str:
    """CreateKey's description of a run's KEK (cut to fit KMS's 8192 characters)."""
    return f"ckptvault key-encryption key of run {json.dumps(run_id)[:7000]}"
