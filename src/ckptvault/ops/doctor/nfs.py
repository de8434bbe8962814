"""``ckptvault doctor`` on NFS: the mount options that decide what a published
generation is worth there.

- **Writes.** ckptvault fsyncs every file and the generation's directories before it
  publishes (a same-directory rename). Over NFS an fsync sends this node's cached
  writes and a COMMIT, which the server answers once the data is on its stable
  storage — if it exports the filesystem ``sync``. An ``async`` export answers at
  once, and a server crash then loses generations ckptvault reported published.
  The client's ``sync``/``async`` mount option changes when writes leave this node,
  not that; the export cannot be seen from here, so the finding says what to check.
- **Security.** ``sec=sys`` (the default) sends checkpoint bytes in clear text, and
  the server believes the user id this node claims; ``krb5``/``krb5i`` authenticate
  (and check) but do not encrypt; ``krb5p`` encrypts. ckptvault's own encryption
  (``keystore=``) covers tensor files on the wire and on the server's disks.
- **Attribute caching.** Unless ``noac`` (or ``actimeo=0``), a node caches a
  directory's attributes for up to ``acdirmax`` seconds (60 by default): another
  node may list the store without its newest generation for that long after a save,
  and a restore there resumes from the generation before.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckptvault.ops.doctor.findings import OK, WARN, Finding
from ckptvault.ops.doctor.mounts import Mount

NFS_DEFAULT_ACDIRMAX = 60  # seconds: the Linux client's default (nfs(5))


def is_nfs(mount: Mount | None) -> bool:
    return mount is not None and mount.fstype in ("nfs", "nfs4")


def check_nfs(root: Path, mount: Mount | None, encrypted: bool) -> list[Finding]:
    """The write, security and caching findings of ``root``'s NFS mount (none when
    it is not on NFS); ``encrypted``: the run encrypts its tensor files (keystore=)."""
    if mount is None or not is_nfs(mount):
        return []
    where = f"{root} (NFS {mount.source}, mounted at {mount.point})"
    return [_writes(where, mount), _security(where, mount, encrypted), _attributes(mount)]


def _writes(where: str, mount: Mount) -> Finding:
    check = "NFS writes"
    export = (
        "ckptvault fsyncs every file and directory before it publishes; over NFS that "
        "sends the data and a COMMIT, which the server acknowledges as on stable storage "
        "only if it exports the filesystem sync: with an async export a server crash "
        "loses generations already reported published"
    )
    fix = (
        "on the server, check the export is sync (the default; exportfs -v lists it), "
        "or save to a local disk and replicate_to= this store"
    )
    if mount.option("sync") is not None:
        return Finding(
            check, OK, f"{where} is mounted sync: writes leave this node at once. {export}"
        )
    return Finding(
        check,
        WARN,
        f"{where} is mounted async (the default): writes wait in this node's cache until "
        f"close or fsync. {export}",
        fix,
    )


def _security(where: str, mount: Mount, encrypted: bool) -> Finding:
    check = "NFS security"
    flavor = mount.option("sec") or "sys"
    if flavor == "krb5p":
        return Finding(check, OK, f"{where}: sec=krb5p, traffic authenticated and encrypted")
    risk = {
        "sys": "checkpoint bytes cross the network in clear text, and the server trusts the "
        "user id this node claims (any host allowed to mount can write as you)",
        "krb5": "users are authenticated, but checkpoint bytes cross the network in clear text "
        "and unchecked",
        "krb5i": "traffic is authenticated and integrity-checked, but not encrypted",
    }.get(flavor, "traffic is not encrypted by NFS")
    if encrypted:
        return Finding(
            check,
            OK,
            f"{where}: sec={flavor}: {risk}; ckptvault encrypts the tensor files (keystore=), "
            "so the wire and the server see ciphertext (manifests stay readable)",
        )
    return Finding(
        check,
        WARN,
        f"{where}: sec={flavor}: {risk}",
        "mount with sec=krb5p, or encrypt in ckptvault (keystore=): tensor files then cross "
        "the wire and rest on the server encrypted",
    )


def _attributes(mount: Mount) -> Finding:
    check = "NFS attribute caching"
    window = attribute_cache_seconds(mount)
    if window == 0:
        return Finding(check, OK, "noac: every node sees a new generation as soon as it exists")
    stale_data = (
        "; nocto also lets it read files' old contents (restore then fails to verify them "
        "and falls back)"
        if mount.option("nocto") is not None
        else ""
    )
    return Finding(
        check,
        WARN,
        f"directory attributes are cached up to {window} s (acdirmax): another node may "
        f"list the store without its newest generation for {window} s after a save, and a "
        f"restore there resumes from the one before{stale_data}",
        f"restart on other nodes only after {window} s, or mount with a lower acdirmax= "
        "(or noac: every lookup asks the server, slower on large stores)",
    )


def attribute_cache_seconds(mount: Mount) -> int:
    """How long a node may list a directory from its cache: 0 with ``noac``, else
    ``acdirmax`` (``actimeo`` sets it too; ``nfs(5)``'s default 60)."""
    if mount.option("noac") is not None:
        return 0
    value = mount.option("acdirmax") or mount.option("actimeo")
    # ASCII digits only: str.isdigit() takes '²', and thousands of digits, that int() refuses.
    if value is not None and re.fullmatch(r"[0-9]{1,9}", value):
        return int(value)
    return NFS_DEFAULT_ACDIRMAX
