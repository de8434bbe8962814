"""How much host memory this process can still take without swapping or being
OOM-killed, and how much room a tmpfs has: what asynchronous staging checks before
it allocates (:mod:`ckptvault.saving.staging_budget`).

Two limits apply, and the smaller one decides:

- the machine's ``MemAvailable`` (``/proc/meminfo``): the kernel's estimate of what
  can be allocated without swapping, page cache it may drop included;
- the memory cgroup this process runs in (a container, a Slurm job, a systemd
  unit): its limit minus what the group already uses, page cache the kernel can
  reclaim (``inactive_file``) not counted as used. A group limit, not the machine,
  is what the OOM killer enforces inside a job. Every level up to the root counts:
  a scheduler often sets the limit on the job, not on the step the process is in.
  cgroup v2 (``memory.max``) and v1 (``memory.limit_in_bytes``) are both read.

The files are read from module-level paths so that a test can point them at a
small, fake machine; nothing else changes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# cgroup v1 writes "no limit" as a huge page-aligned number; anything at or above
# this is no limit.
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Available:
    """``bytes`` this process can still allocate, and which limit that is
    (``"MemAvailable in /proc/meminfo"``, ``"memory cgroup /job (limit ...)"``)."""

    bytes: int
    limit: str


def available_memory() -> Available | None:
    """The smaller of ``MemAvailable`` and what this process's memory cgroups leave;
    None when neither can be read (not Linux)."""
    candidates = [c for c in (_meminfo_available(), _cgroup_available()) if c is not None]
    return min(candidates, key=lambda c: c.bytes) if candidates else None


def free_space(directory: Path) -> int | None:
    """Bytes an unprivileged user can still write under ``directory`` (a tmpfs such as
    ``/dev/shm``: that is memory); None when it cannot be read."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def _meminfo_available() -> Available | None:
    try:
        text = MEMINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name == "MemAvailable" and fields and fields[0].isdigit():
            unit = 1024 if fields[1:] == ["kB"] else 1
            return Available(int(fields[0]) * unit, f"MemAvailable in {MEMINFO}")
    return None


def _cgroup_available() -> Available | None:
    """What the tightest memory cgroup above this process leaves (v2, else v1)."""
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except OSError:
        return None
    best: Available | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found = _tightest(CGROUP_ROOT, parts[2], _V2)
        elif "memory" in parts[1].split(","):
            found = _tightest(CGROUP_ROOT / "memory", parts[2], _V1)
        else:
            continue
        if found is not None and (best is None or found.bytes < best.bytes):
            best = found
    return best


@dataclass(frozen=True)
class _Files:
    limit: str
    usage: str
    reclaimable: str  # the key in memory.stat


_V2 = _Files("memory.max", "memory.current", "inactive_file")
_V1 = _Files("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _tightest(root: Path, group: str, files: _Files) -> Available | None:
    """Walk from ``group`` up to ``root``: the level that leaves the least."""
    if not group.startswith("/"):
        return None
    relative = Path(group).relative_to("/")
    best: Available | None = None
    for level in [relative, *relative.parents]:
        directory = root / level
        left = _left_in(directory, files)
        if left is not None and (best is None or left < best.bytes):
            name = "/" if level == Path(".") else f"/{level}"
            best = Available(left, f"memory cgroup {name} ({directory})")
    return best


def _left_in(directory: Path, files: _Files) -> int | None:
    """Limit minus usage (reclaimable page cache not counted) of one cgroup; None
    without a limit or when unreadable."""
    try:
        limit_text = (directory / files.limit).read_text().strip()
        usage = int((directory / files.usage).read_text().strip())
    except (OSError, ValueError):
        return None
    if not limit_text.isdigit() or int(limit_text) >= _V1_UNLIMITED:
        return None  # "max" (v2) or v1's huge number: no limit here
    reclaimable = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == files.reclaimable and value.strip().isdigit():
                reclaimable = int(value)
                break
    except OSError:
        pass
    return max(0, int(limit_text) - max(0, usage - reclaimable))
