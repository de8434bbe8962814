"""``ckptvault doctor`` for an ``s3://`` store: the bucket's lifecycle rules.

Two things a lifecycle configuration does to a checkpoint store:

- **Expiration** deletes objects by age, whatever ckptvault's retention decided.
  Retention always keeps the newest verified generation and a fallback, however
  old; an Expiration rule covering the store deletes them anyway once a run stops
  saving for that many days, and data objects of generations retention keeps when
  they are older than that (restore then finds those generations damaged and falls
  back, or finds none). Seed 003: lifecycle rules must preserve the recovery
  horizon. A rule shorter than the horizon fails; any other covering Expiration is a
  warning. The horizon is the longest of: the retention the operator states, the
  age of the oldest generation the store holds, and what the retention policies the
  managers recorded in the store keep (:func:`policy_horizon`; a record is store
  data, so a forged one can only make the doctor stricter).
- **AbortIncompleteMultipartUpload**: a save killed mid-upload leaves parts S3
  keeps, and bills, until the upload is aborted (seed 001). ckptvault aborts stale
  attempts when a writer opens the store again and in ``ckptvault gc``, but a store
  nobody writes again keeps them for ever: a rule is the backstop.

A rule covers the store when its prefix and the store's prefix overlap (one starts
with the other: a rule on ``run/data/`` expires the data but not the manifests,
which is worse). Rules selecting by tag never match: ckptvault tags no object.
Disabled rules do nothing.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from typing import Any

from ckptvault.ops.doctor.findings import FAIL, OK, SKIP, WARN, Finding
from ckptvault.retention.policy import Retention
from ckptvault.storage.s3.client import S3Error

EXPIRY, ABORT = "bucket lifecycle expiration", "bucket lifecycle aborts uploads"
TRANSITION = "bucket lifecycle transitions"
# Storage classes whose objects a GET cannot read until a RestoreObject request
# (hours) brings them back: restore would find those generations unreadable.
ARCHIVE_CLASSES = frozenset({"GLACIER", "DEEP_ARCHIVE"})


@dataclass(frozen=True)
class Horizon:
    """How many ``days`` back retention keeps generations, and why that many
    (``"the oldest generation here, step 100, is 12 days old"``); 0: unknown."""

    days: float = 0.0
    why: str = "unknown"


def policy_horizon(policy: Retention) -> Horizon:
    """How old the generations ``policy`` keeps may be. ``keep_every`` (milestones)
    and ``keep_best`` (the best of the whole run) keep generations of any age: for
    ever. Calendar rules and ``keep_within`` keep back that far. ``keep_last`` keeps
    the newest, young while the run saves (the warning covers a run that stops)."""
    described = policy.describe()
    if policy.keep_every is not None or policy.keep_best is not None:
        return Horizon(math.inf, f"the recorded retention ({described}) keeps them at any age")
    days = max(
        (policy.keep_within or 0) / 86400,
        (policy.keep_hourly or 0) / 24,
        float(policy.keep_daily or 0),
        7.0 * (policy.keep_weekly or 0),
    )
    return Horizon(days, f"the recorded retention: {described}")


def longest(*horizons: Horizon) -> Horizon:
    return max(horizons, key=lambda h: h.days)


def check_lifecycle(client: Any, prefix: str, horizon: Horizon) -> list[Finding]:
    """``prefix``: the store's key prefix ("" or ending in "/")."""
    try:
        answer = client.call("get_bucket_lifecycle_configuration")
    except S3Error as exc:
        if exc.code != "NoSuchLifecycleConfiguration":
            why = f"cannot read the lifecycle configuration: {exc}"
            fix = "grant s3:GetLifecycleConfiguration to the checking identity to check it"
            return [Finding(EXPIRY, SKIP, why, fix), Finding(ABORT, SKIP, why, fix)]
        answer = {}
    rules = [r for r in answer.get("Rules", []) if r.get("Status") == "Enabled"]
    covering = [r for r in rules if covers(rule_prefix(r), prefix)]
    where = f"s3://{client.bucket}/{prefix}"
    return [
        _expiration(covering, where, horizon),
        _transition(covering, where, horizon),
        _abort(covering, where, client.bucket, prefix),
    ]


def rule_prefix(rule: dict[str, Any]) -> str | None:
    """The key prefix ``rule`` applies to ("" the whole bucket); None when it selects
    by tag (ckptvault's objects carry none, so it never matches them)."""
    selector = rule.get("Filter")
    if selector is None:  # the older form: Prefix beside the rule's other fields
        return str(rule.get("Prefix", ""))
    if "Tag" in selector:
        return None
    if "And" in selector:
        both = selector["And"]
        return None if both.get("Tags") else str(both.get("Prefix", ""))
    return str(selector.get("Prefix", ""))  # {} or a size filter: every key


def covers(rule_prefix: str | None, store_prefix: str) -> bool:
    if rule_prefix is None:
        return False
    return store_prefix.startswith(rule_prefix) or rule_prefix.startswith(store_prefix)


def _name(rule: dict[str, Any]) -> str:
    prefix = rule_prefix(rule)
    scope = f"prefix {prefix!r}" if prefix else "the whole bucket"
    return f"rule {rule.get('ID', '(no ID)')!r} ({scope})"


def _expiration(rules: list[dict[str, Any]], where: str, horizon: Horizon) -> Finding:
    expiring = [
        r for r in rules if "Days" in r.get("Expiration", {}) or "Date" in r.get("Expiration", {})
    ]
    if not expiring:
        return Finding(EXPIRY, OK, f"no lifecycle rule expires objects under {where}")
    fix = (
        f"exclude {where} from the rule (a Prefix or tag filter that does not match it) and "
        "let ckptvault delete generations (retention=, ckptvault gc): it never deletes the "
        "newest verified one"
    )
    shortest = min(expiring, key=lambda r: r["Expiration"].get("Days", -1))
    expiration = shortest["Expiration"]
    if "Days" not in expiration:
        return Finding(
            EXPIRY,
            FAIL,
            f"{_name(shortest)} expires every object under {where} on {expiration['Date']}, "
            "generations retention keeps included",
            fix,
        )
    days = int(expiration["Days"])
    if days < horizon.days:
        reach = "unbounded" if math.isinf(horizon.days) else f"{horizon.days:.0f} days"
        return Finding(
            EXPIRY,
            FAIL,
            f"{_name(shortest)} expires objects {days} days after they are written, inside "
            f"the retention horizon ({reach}: {horizon.why}): S3 deletes generations "
            "retention keeps, and restore finds them damaged or gone",
            fix,
        )
    return Finding(
        EXPIRY,
        WARN,
        f"{_name(shortest)} expires every object under {where} {days} days after it is "
        f"written, the newest generation too: a run that saves nothing for {days} days "
        "(paused, finished, waiting for a restart) loses every checkpoint",
        fix,
    )


def _transition(rules: list[dict[str, Any]], where: str, horizon: Horizon) -> Finding:
    """Transitions to an archive class: objects there answer a GET with
    InvalidObjectState until restored, so a generation moved there no longer restores
    (restore reports it damaged and falls back to an older one, if any is left)."""
    archiving = [
        (int(t["Days"]), t.get("StorageClass", ""), r)
        for r in rules
        for t in r.get("Transitions", [])
        if t.get("StorageClass") in ARCHIVE_CLASSES and isinstance(t.get("Days"), int)
    ]
    if not archiving:
        return Finding(
            TRANSITION, OK, f"no lifecycle rule moves objects under {where} to an archive"
        )
    days, storage_class, rule = min(archiving, key=lambda a: a[0])
    fix = (
        f"exclude {where} from the rule, or transition to a class a GET reads at once "
        "(GLACIER_IR, STANDARD_IA): ckptvault restores by GET and never asks S3 to restore "
        "an archived object"
    )
    status = FAIL if days < horizon.days else WARN
    reach = "unbounded" if math.isinf(horizon.days) else f"{horizon.days:.0f} days"
    return Finding(
        TRANSITION,
        status,
        f"{_name(rule)} moves objects under {where} to {storage_class} {days} days after they "
        f"are written (retention horizon {reach}): a generation there cannot be read until "
        "S3 restores it (hours), so restore finds it unreadable and falls back",
        fix,
    )


def _abort(rules: list[dict[str, Any]], where: str, bucket: str, prefix: str) -> Finding:
    aborting = [r for r in rules if "AbortIncompleteMultipartUpload" in r]
    if aborting:
        days = min(
            int(r["AbortIncompleteMultipartUpload"].get("DaysAfterInitiation", 0)) for r in aborting
        )
        return Finding(
            ABORT,
            OK,
            f"{_name(aborting[0])} aborts uploads left incomplete for {days} days under {where}",
        )
    rule = {
        "ID": "ckptvault-abort-incomplete-uploads",
        "Status": "Enabled",
        "Filter": {"Prefix": prefix},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 7},
    }
    # Quoted for a shell: a key prefix may hold any character, a quote included.
    configuration = shlex.quote(json.dumps({"Rules": [rule]}))
    return Finding(
        ABORT,
        WARN,
        f"no lifecycle rule aborts incomplete multipart uploads under {where}: a save killed "
        "mid-upload leaves parts that S3 keeps, and bills, until someone aborts them "
        "(ckptvault does when a writer opens the store again, or in ckptvault gc)",
        f"add to the bucket's lifecycle rules (put-bucket-lifecycle-configuration replaces "
        f"them all: merge with the existing ones): aws s3api put-bucket-lifecycle-configuration "
        f"--bucket {shlex.quote(bucket)} --lifecycle-configuration {configuration} "
        "(7 days: longer than any one save's upload, which must not be aborted)",
    )
