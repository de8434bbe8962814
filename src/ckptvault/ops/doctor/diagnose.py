"""``ckptvault doctor``: check a deployment's security and durability posture and
say what to fix.

The checks look at where things live and who may write them, never at checkpoint
contents (``ckptvault verify`` does that): the store (its permissions, its
filesystem, its free space; on Lustre its striping, :mod:`~ckptvault.ops.doctor.lustre`;
on NFS its mount options, :mod:`~ckptvault.ops.doctor.nfs`), the control-plane files
outside it (rollback ledger, audit log, catalog, key store, signing key), whether
asynchronous saves' staging fits in this host's memory
(:mod:`~ckptvault.ops.doctor.memory`) and, for an ``s3://`` or ``az://`` store, the
bucket's or container's protections, lifecycle rules and the credentials in use
(:mod:`~ckptvault.ops.doctor.s3`, :mod:`~ckptvault.ops.doctor.lifecycle`,
:mod:`~ckptvault.ops.doctor.azure`). Each check
yields a :class:`Finding`: ``ok``, ``warn`` (works, but weaker than it should be),
``fail`` (a hole: fix it before trusting the store) or ``skip`` (could not check).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ckptvault.errors import CheckpointError
from ckptvault.format.layout import generation_id_time
from ckptvault.ops.doctor.findings import FAIL, OK, SKIP, WARN, Finding
from ckptvault.ops.doctor.lifecycle import Horizon, check_lifecycle, longest, policy_horizon
from ckptvault.ops.doctor.lustre import check_lustre
from ckptvault.ops.doctor.memory import check_staging_memory
from ckptvault.ops.doctor.mounts import MOUNTINFO, Mount, mount_of
from ckptvault.ops.doctor.nfs import check_nfs
from ckptvault.retention.recorded import RETENTION_RECORD, parse_record
from ckptvault.storage.base import Store
from ckptvault.storage.listing import GenerationInfo, list_generation_infos
from ckptvault.trust.ledger import default_ledger_path

# Filesystems whose contents do not outlive the machine, and those whose fsync and
# rename guarantees depend on a server.
VOLATILE_FS = {"tmpfs", "ramfs", "devtmpfs"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "fuse.sshfs", "9p", "virtiofs"}
STORAGE_WARN_USED, STORAGE_FAIL_USED = 0.85, 0.95  # seed 002's storage threshold


@dataclass(frozen=True)
class Places:
    """The control-plane files to check; None: the defaults beside the ledger."""

    ledger: Path | None = None
    audit_log: Path | None = None
    keystore: str | None = None
    signing_key: Path | None = None


@dataclass(frozen=True)
class RunPlan:
    """What the job will do, where the doctor cannot see it: ``state_bytes`` one rank
    saves (None: the largest generation in the store), asynchronous saves'
    ``max_in_flight``, ``async_mode`` and ranks per node, and how many days its
    retention keeps generations (None: as old as the oldest one in the store)."""

    state_bytes: int | None = None
    max_in_flight: int = 1
    async_mode: str = "thread"
    ranks_per_node: int = 1
    retention_days: float | None = None


@dataclass(frozen=True)
class Host:
    """Where this machine's facts are read (tests describe another machine)."""

    mountinfo: Path = MOUNTINFO


def diagnose(
    store: Store, places: Places, plan: RunPlan | None = None, host: Host | None = None
) -> list[Finding]:
    """Every check for ``store``, the files in ``places`` and the job in ``plan``."""
    plan, host = plan or RunPlan(), host or Host()
    findings: list[Finding] = []
    root = _local_root(store)
    generations = _listed(store)
    if root is not None:
        mount = mount_of(root, host.mountinfo)
        findings += check_store_directory(root, mount)
        largest = max((g.bytes for g in generations), default=0)
        findings += check_lustre(root, mount, largest)
        findings += check_nfs(root, mount, encrypted=places.keystore is not None)
    else:
        findings += _object_store_checks(store, generations, plan)
    findings.append(_staging_memory(generations, plan))
    ledger = places.ledger or default_ledger_path()
    for what, path in (
        ("ledger", ledger),
        ("audit log", places.audit_log or ledger.with_name("audit.jsonl")),
        ("catalog", ledger.with_name("catalog.sqlite3")),
    ):
        findings += check_private_file(what, path, store)
    if places.keystore is not None:
        findings += check_keystore(places.keystore, store, root)
    if places.signing_key is not None:
        findings += check_private_file(
            "signing key", places.signing_key, store, required=True, secret=True
        )
    return findings


def _object_store_checks(
    store: Store, generations: list[GenerationInfo], plan: RunPlan
) -> list[Finding]:
    """The bucket's or container's protections (and an S3 bucket's lifecycle rules),
    by the kind of store: each backend's doctor module knows its service."""
    from ckptvault.ops.doctor.azure import check_azure  # neither loads its SDK to import
    from ckptvault.ops.doctor.s3 import check_s3
    from ckptvault.storage.azure.store import AzureStore

    if isinstance(store, AzureStore):
        return check_azure(store)

    horizon = longest(_horizon(generations, plan.retention_days), _recorded_horizon(store))
    return check_s3(store) + _lifecycle(store, horizon)


def _local_root(store: Store) -> Path | None:
    root = getattr(store, "root", None)
    return Path(root) if root is not None else None


def _listed(store: Store) -> list[GenerationInfo]:
    """The store's generations as listed (sizes from the listing, nothing read or
    verified: advice, not trust); none when it cannot be listed."""
    try:
        return list_generation_infos(store)
    except (OSError, CheckpointError):
        return []


def _horizon(generations: list[GenerationInfo], retention_days: float | None) -> Horizon:
    """How far back retention keeps generations: the stated retention, or the age of
    the oldest generation the store holds (retention has not dropped it), the longer."""
    horizon = Horizon()
    if retention_days is not None:
        horizon = Horizon(retention_days, f"the stated retention of {retention_days:g} days")
    now = datetime.now(timezone.utc)
    for generation in generations:
        try:
            age = (now - generation_id_time(generation.generation_id)).total_seconds() / 86400
        except ValueError:
            continue
        if age > horizon.days:
            horizon = Horizon(
                age, f"the oldest generation here, step {generation.step}, is {age:.0f} days old"
            )
    return horizon


# Retention records read at most: one per run; a store holds a handful.
MAX_POLICY_RECORDS = 16


def _recorded_horizon(store: Store) -> Horizon:
    """The longest horizon of the retention policies recorded in the store (one per
    run; unreadable or invalid records are passed over, as gc does)."""
    try:
        records = store.list_records(RETENTION_RECORD, limit=MAX_POLICY_RECORDS)
    except (OSError, CheckpointError):
        return Horizon()
    horizons = [Horizon()]
    for document in records.values():
        run_id = document.get("run_id")
        try:
            policy = parse_record(document, run_id if isinstance(run_id, str) else "")
        except CheckpointError:
            continue
        horizons.append(policy_horizon(policy))
    return longest(*horizons)


def _lifecycle(store: Store, horizon: Horizon) -> list[Finding]:
    client, layout = getattr(store, "client", None), getattr(store, "layout", None)
    if client is None or layout is None:
        return []
    return check_lifecycle(client, layout.prefix, horizon)


def _staging_memory(generations: list[GenerationInfo], plan: RunPlan) -> Finding:
    size, source = plan.state_bytes, "as given"
    if size is None and generations:
        largest = max(generations, key=lambda g: g.bytes)
        size = largest.bytes
        source = (
            f"the largest generation here, step {largest.step}; a job of several ranks "
            "stages only each rank's share of it"
        )
    return check_staging_memory(
        size, source, plan.max_in_flight, plan.async_mode, plan.ranks_per_node
    )


# -- the store directory -----------------------------------------------------------


def check_store_directory(root: Path, mount: Mount | None) -> list[Finding]:
    """``mount``: the mount holding ``root`` (None: unknown)."""
    info = os.stat(root)
    findings = [_writers("store", root, info, directory=True)]
    findings.append(_filesystem(root, mount))
    findings.append(_free_space(root))
    return findings


def _writers(what: str, path: Path, info: os.stat_result, directory: bool) -> Finding:
    """Who besides its owner may change ``path``."""
    mode = stat.S_IMODE(info.st_mode)
    check = f"{what} permissions"
    if mode & stat.S_IWOTH:  # sticky or not: anyone can plant generations
        return Finding(
            check,
            FAIL,
            f"{path} is writable by every user ({oct(mode)}): anyone can plant or delete "
            "generations",
            f"chmod o-w {path}, or keep the store in a directory of its own",
        )
    owner_is_me = not hasattr(os, "getuid") or info.st_uid in (os.getuid(), 0)
    if not owner_is_me:
        return Finding(
            check,
            WARN,
            f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})",
            "run the job as the store's owner, or make sure you trust that user",
        )
    if mode & stat.S_IWGRP:
        return Finding(
            check,
            WARN,
            f"{path} is writable by its group ({oct(mode)}): every member can delete or "
            "plant generations",
            f"chmod g-w {path}, unless the group is exactly the job's writers",
        )
    return Finding(check, OK, f"{path}: only its owner writes it ({oct(mode)})")


def _filesystem(root: Path, mount: Mount | None) -> Finding:
    kind = mount.fstype if mount is not None else None
    if kind is None:
        return Finding("store filesystem", SKIP, "cannot tell the filesystem type here")
    if kind in VOLATILE_FS:
        return Finding(
            "store filesystem",
            WARN,
            f"{root} is on {kind}: it does not survive a reboot or the loss of the node",
            "keep it as the fast tier and add replicate_to= a durable store",
        )
    if kind in NETWORK_FS or kind.startswith("fuse"):
        return Finding(
            "store filesystem",
            WARN,
            f"{root} is on {kind}: fsync and atomic rename depend on the server and client "
            "settings",
            "prefer a local disk (replicating to shared storage) or an s3:// or az:// store",
        )
    return Finding("store filesystem", OK, f"{root} is on {kind}")


def _free_space(root: Path) -> Finding:
    usage = os.statvfs(root)
    total = usage.f_blocks * usage.f_frsize
    if total == 0:
        return Finding("store free space", SKIP, f"{root}: the filesystem reports no size")
    used = 1 - usage.f_bavail * usage.f_frsize / total
    detail = f"{used:.0%} of {total / 1e9:.1f} GB used"
    fix = "delete old generations (ckptvault gc) or tighten retention before saves fail"
    if used >= STORAGE_FAIL_USED:
        return Finding("store free space", FAIL, detail, fix)
    if used >= STORAGE_WARN_USED:
        return Finding("store free space", WARN, detail, fix)
    return Finding("store free space", OK, detail)


# -- control-plane files -------------------------------------------------------------


def check_private_file(
    what: str, path: Path, store: Store, required: bool = False, secret: bool = False
) -> list[Finding]:
    """A control-plane file must be outside the store and writable by its owner only;
    a ``secret`` one (keys) readable by its owner only."""
    check = f"{what} location"
    if store.holds_path(path):
        return [
            Finding(
                check,
                FAIL,
                f"the {what} ({path}) is inside the store {store.location}: whoever can "
                "write the store can rewrite it",
                f"move it outside the store and pass its new path ({what.replace(' ', '_')}=)",
            )
        ]
    if not path.exists():
        status = FAIL if required else OK
        detail = f"{path} does not exist" + ("" if required else " yet (created on first use)")
        return [Finding(check, status, detail)]
    findings = [Finding(check, OK, f"{path} is outside the store")]
    findings.append(_private(what, path, os.stat(path), secret))
    findings += _directories(what, path)
    return findings


def _directories(what: str, path: Path) -> list[Finding]:
    """The directory holding ``path`` and, when ``path`` is a symlink, the one holding
    what it points at: whoever can write either can replace the file."""
    real = Path(os.path.realpath(path))
    findings = []
    for directory in dict.fromkeys((path.absolute().parent, real.parent)):
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            linked = "" if directory == path.absolute().parent else f" ({path} links there)"
            findings.append(
                Finding(
                    f"{what} directory",
                    FAIL,
                    f"{directory}{linked} is writable by others ({oct(mode)}): they can "
                    f"replace the {what}",
                    f"chmod 700 {directory}, or keep the {what} in a private directory",
                )
            )
    return findings


def _private(what: str, path: Path, info: os.stat_result, secret: bool) -> Finding:
    mode = stat.S_IMODE(info.st_mode)
    if mode & (0o077 if secret else 0o022):
        opened = "readable or writable" if secret else "writable"
        return Finding(
            f"{what} permissions",
            FAIL,
            f"{path} is {opened} by other users ({oct(mode)})",
            f"chmod {'700' if stat.S_ISDIR(info.st_mode) else '600'} {path}",
        )
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return Finding(
            f"{what} permissions",
            WARN,
            f"{path} belongs to uid {info.st_uid}, not this user",
            "run the job as its owner",
        )
    private = "only its owner can read or write it" if secret else "only its owner can write it"
    return Finding(f"{what} permissions", OK, f"{path}: {private} ({oct(mode)})")


def check_keystore(location: str, store: Store, root: Path | None) -> list[Finding]:
    if "://" in location:
        return [Finding("key store", OK, f"{location}: keys are held by a key service")]
    path = Path(location)
    findings = check_private_file("key store", path, store, required=True, secret=True)
    if root is not None and path.exists() and os.stat(path).st_dev == os.stat(root).st_dev:
        findings.append(
            Finding(
                "key store volume",
                WARN,
                f"{path} is on the same filesystem as the store: a snapshot or stolen disk "
                "carries keys and data together, and crypto-erase cannot reach old copies",
                "keep keys on another volume, or use a key service (kms://...)",
            )
        )
    return findings
