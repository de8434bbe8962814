"""The rotation journal: which manifests a key rotation verified before replacing them.

A signed generation's signature is replaced before its manifest (see
``Store.replace_manifest``), so a crash in between leaves the new signature beside
the old manifest. That manifest's signature then no longer verifies, and a resumed
rotation could not tell it from a generation someone planted with a bogus signature
— and re-signing a planted manifest would launder it. So before replacing a signed
manifest, rotation records the BLAKE3 of the exact bytes it verified (signature
included) in this journal, and a resumed rotation accepts an unverifiable signature
only beside a manifest recorded here.

The journal is control-plane state like the ledger: it lives beside it (the per-user
state directory by default, ``rotations/``), never in the store, one file per run,
written atomically; it is removed when the rotation finishes. A journal of another
rotation (another new KEK) vouches for nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from blake3 import blake3

from ckptvault.durable import write_atomically

MAX_JOURNAL_BYTES = 64 * 1024 * 1024


def journal_path(directory: Path, run_id: str) -> Path:
    return directory / f"rotation-{blake3(run_id.encode('utf-8')).hexdigest()[:40]}.json"


class RotationJournal:
    """The journal of one rotation of one run (to one new KEK)."""

    def __init__(self, path: Path, run_id: str, new_kek_id: str) -> None:
        self.path = path
        self.run_id = run_id
        self.new_kek_id = new_kek_id
        self.verified: dict[str, str] = self._load()

    def _load(self) -> dict[str, str]:
        try:
            if self.path.stat().st_size > MAX_JOURNAL_BYTES:
                return {}
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # none yet, or damaged: it vouches for nothing
        if (
            not isinstance(raw, dict)
            or raw.get("run_id") != self.run_id
            or raw.get("new_kek_id") != self.new_kek_id
            or not isinstance(raw.get("verified"), dict)
        ):
            return {}
        return {str(k): str(v) for k, v in raw["verified"].items()}

    def note(self, generation_id: str, manifest: bytes) -> None:
        """Record, durably, that ``manifest`` of ``generation_id`` verified."""
        self.verified[generation_id] = blake3(manifest).hexdigest()
        document = {"run_id": self.run_id, "new_kek_id": self.new_kek_id, "verified": self.verified}
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(self.path, json.dumps(document, sort_keys=True).encode(), mode=0o600)

    def vouches(self, generation_id: str, manifest: bytes) -> bool:
        return self.verified.get(generation_id) == blake3(manifest).hexdigest()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
