"""Which mount holds a path, its filesystem type and its options, from the kernel's
mount table (``/proc/self/mountinfo``; the ``/proc/mounts`` format is read too).

The doctor's filesystem checks (:mod:`~ckptvault.ops.doctor.nfs`,
:mod:`~ckptvault.ops.doctor.lustre`) start here: the mount whose mount point is the
longest prefix of the store's resolved path. ``mountinfo`` splits options into the
mount's own (``rw,noatime``) and the filesystem's (``vers=4.2,sec=krb5p,...``); a
:class:`Mount` holds both together, as ``mount`` prints them. The table's path is a
parameter so that tests can describe any machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")

_ESCAPE_RE = re.compile(r"\\([0-7]{3})")  # the kernel writes " " as \040, "\" as \134


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    source: str
    options: dict[str, str] = field(default_factory=dict)  # a flag: ""

    def option(self, name: str) -> str | None:
        return self.options.get(name)


def _unescape(text: str) -> str:
    return _ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 8)), text)


def _options(*texts: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for text in texts:
        for item in text.split(","):
            if item:
                name, _, value = item.partition("=")
                found[name] = value
    return found


def parse_line(line: str) -> Mount | None:
    """One line of ``mountinfo`` or of ``/proc/mounts``; None for anything else."""
    fields = line.split()
    if "-" in fields[6:] and fields[0].isdigit():  # mountinfo: ... opts [optional] - type src
        dash = fields.index("-", 6)
        if len(fields) < dash + 3:
            return None
        super_options = fields[dash + 3] if len(fields) > dash + 3 else ""
        return Mount(
            _unescape(fields[4]),
            fields[dash + 1],
            _unescape(fields[dash + 2]),
            _options(fields[5], super_options),
        )
    if len(fields) >= 4:  # /proc/mounts: source point type options dump pass
        return Mount(_unescape(fields[1]), fields[2], _unescape(fields[0]), _options(fields[3]))
    return None


def read_mounts(table: Path = MOUNTINFO) -> list[Mount] | None:
    """Every mount in ``table``; None when it cannot be read (not Linux)."""
    try:
        text = table.read_text(errors="replace")
    except OSError:
        return None
    return [m for m in map(parse_line, text.splitlines()) if m is not None]


def mount_of(path: Path, table: Path = MOUNTINFO) -> Mount | None:
    """The mount holding ``path``: the longest mount point that is ``path`` or one of
    its parents (the last one mounted there wins, as in the kernel); None when the
    table cannot be read or lists none."""
    mounts = read_mounts(table)
    if not mounts:
        return None
    resolved = str(path.resolve())
    best: Mount | None = None
    for mount in mounts:
        point = mount.point.rstrip("/") or "/"
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = mount
    return best
