"""``ckptvault doctor`` on Lustre: how the store's new files will be striped.

A Lustre file's data sits on as many object storage targets (OSTs) as its stripe
count says, fixed when the file is created from its directory's default layout.
The filesystem's usual default is a stripe count of 1 (seed 001, after the Lustre
2.x manual), which caps every checkpoint file at one OST's bandwidth and space: a
save of many gigabytes then crawls while the rest of the filesystem idles. So when
generations exceed 1 GB, a store directory whose new files get one stripe is a
warning, with the command that fixes it for the files written after it:
``lfs setstripe -c -1 DIR`` (-1: every available OST, full ones skipped, as the
manual defines it).

The layout is read with ``lfs getstripe -d`` (the directory's default only, never a
walk of every file), under a timeout: a hung metadata server must not hang the
doctor. Output that cannot be understood, a failing or missing ``lfs`` are
reported as checks that could not be made, never raised.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from ckptvault.ops.doctor.findings import OK, SKIP, WARN, Finding
from ckptvault.ops.doctor.mounts import Mount

CHECK = "store Lustre striping"
LFS_TIMEOUT_S = 20.0
BIG_GENERATION_BYTES = 10**9  # above this, one OST per file is the bottleneck
ALL_OSTS = -1
# "stripe_count:  4" (a directory's default) or "lmm_stripe_count:  4" (a file's).
# ASCII digits, at most 9 (int() of thousands of digits raises): anything else is not
# understood, and the check is skipped.
_COUNT_RE = re.compile(r"^\s*(?:lmm_)?stripe_count:\s*(-?[0-9]{1,9})\b", re.MULTILINE)


def parse_stripe_count(output: str) -> int | None:
    """The stripe count new files get from ``lfs getstripe -d`` output; None when
    it shows none (no layout of its own, or output not understood). A composite
    (PFL) layout lists one count per extent: the last extent runs to the end of the
    file, where a large checkpoint's bytes are, so its count is the one that
    matters. 0 means "the filesystem default", which this layout does not say."""
    counts = [int(c) for c in _COUNT_RE.findall(output)]
    if not counts or counts[-1] == 0 or counts[-1] < ALL_OSTS:
        return None
    return counts[-1]


def check_lustre(root: Path, mount: Mount | None, largest_generation: int) -> list[Finding]:
    """The stripe count of ``root``'s new files, when ``root`` is on Lustre;
    ``largest_generation``: bytes of the largest generation listed in the store."""
    if mount is None or mount.fstype != "lustre":
        return []
    lfs = shutil.which("lfs")
    if lfs is None:
        return [
            Finding(
                CHECK,
                SKIP,
                f"{root} is on Lustre, but lfs is not on PATH: cannot read its striping",
                "install the Lustre client tools (lfs), or run lfs getstripe -d on it",
            )
        ]
    # The store's own default layout; without one, new files take the filesystem's
    # (the default of the mount's root directory).
    inherited, shown = "", ""
    for directory in dict.fromkeys((root, Path(mount.point))):
        answer = _getstripe(lfs, directory)
        if isinstance(answer, Finding):
            return [answer]
        count = parse_stripe_count(answer)
        if count is not None:
            return [_verdict(root, count, largest_generation, inherited)]
        inherited = f" (no layout of its own: the filesystem default at {mount.point})"
        shown = answer
    return [
        Finding(
            CHECK,
            SKIP,
            f"lfs getstripe -d shows no stripe count for {root} or {mount.point}: "
            f"{_excerpt(shown)}",
            f"read it yourself: lfs getstripe -d {shlex.quote(str(root))}",
        )
    ]


def _getstripe(lfs: str, directory: Path) -> str | Finding:
    """``lfs getstripe -d DIRECTORY``'s output, or the finding that says why not."""
    command = [lfs, "getstripe", "-d", str(directory)]
    shown = shlex.join(["lfs", *command[1:]])
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, errors="replace", timeout=LFS_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return Finding(
            CHECK,
            SKIP,
            f"{shown} did not answer within {LFS_TIMEOUT_S:.0f} s (a busy or unreachable "
            "metadata server?)",
            "run it again when the filesystem answers",
        )
    except OSError as exc:
        return Finding(CHECK, SKIP, f"cannot run {shown}: {exc.strerror or exc}")
    if done.returncode != 0:
        return Finding(
            CHECK,
            SKIP,
            f"{shown} failed (exit {done.returncode}): {_excerpt(done.stderr or done.stdout)}",
            "check that the directory is on a mounted Lustre filesystem",
        )
    return done.stdout


def _verdict(root: Path, count: int, largest: int, inherited: str) -> Finding:
    size = f"{largest / 1e9:.1f} GB"
    if count == ALL_OSTS:
        return Finding(CHECK, OK, f"new files stripe over every available OST (-1){inherited}")
    if count > 1:
        return Finding(CHECK, OK, f"new files stripe over {count} OSTs{inherited}")
    if largest <= BIG_GENERATION_BYTES:
        return Finding(
            CHECK,
            OK,
            f"new files get one stripe (one OST){inherited}; fine for the generations here "
            f"(largest {size}, under 1 GB)",
        )
    return Finding(
        CHECK,
        WARN,
        f"new files get one stripe{inherited}: each checkpoint file sits on a single OST, "
        f"whose bandwidth and free space cap saves and restores of generations up to {size}",
        f"lfs setstripe -c -1 {shlex.quote(str(root))} (-1: stripe over every available "
        "OST, full ones skipped; seed 001 after the Lustre 2.x manual; -c N for fewer when "
        "other jobs share the OSTs). It applies to files created afterwards: run it while "
        "no job writes the store",
    )


def _excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return (flat[:200] + "...") if len(flat) > 200 else (flat or "no output")
