"""The environment a generation was saved in, compared with the one restoring it.

Every manifest's contract records the versions of ckptvault, torch, NumPy and Python,
the CUDA version torch was built with and the number of CUDA devices the process saw
(:func:`environment_versions`). A resume is only exact in the same environment (seed
002: on resume, verify that the environment matches), so restore lists every
difference in ``RestoreInfo.environment`` with a warning, and refuses under
``strict_env=True``. Generations written before the CUDA fields existed are compared
on the fields they have.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckptvault._version import __version__

# Display names, in the order differences are listed.
FIELDS = {
    "ckptvault": "ckptvault",
    "torch": "torch",
    "numpy": "NumPy",
    "python": "Python",
    "cuda": "CUDA",
    "cuda_devices": "CUDA devices",
}


def environment_versions() -> dict[str, Any]:
    """What this process runs: the ``versions`` object of a new manifest's contract."""
    return {
        "ckptvault": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def _shown(value: Any) -> str:
    """At most 40 characters of ``value``, control characters escaped: the stored side
    is untrusted, and these lines reach logs and terminals (no escape sequences)."""
    if value is None:
        return "none"
    if not isinstance(value, (str, int, float, bool)):
        return f"a {type(value).__name__}"  # not a version: never str() a whole tree
    text = str(value)
    cut = text[:40]
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in cut)
    return shown if len(text) <= 40 else shown + "..."


def environment_differences(contract: Any) -> list[str]:
    """Each field of the saved environment that differs from this process's, as
    ``"torch: 2.12.0 (saved) -> 2.13.0 (now)"``; fields the manifest lacks are skipped."""
    saved = contract.get("versions") if isinstance(contract, Mapping) else None
    if not isinstance(saved, Mapping):
        return []
    now = environment_versions()
    return [
        f"{label}: {_shown(saved[field])} (saved) -> {_shown(now[field])} (now)"
        for field, label in FIELDS.items()
        if field in saved and saved[field] != now[field]
    ]
