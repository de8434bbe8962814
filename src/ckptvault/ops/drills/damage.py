"""Drills that damage or plant generations: each expects restore to skip the bad
generation, with the rule's own reason code, and to take the good one.

- truncated file (``size-mismatch``), flipped byte (``digest-mismatch``), missing
  file (``file-missing``): the newest generation is damaged; the previous one is
  restored;
- extra pickle file (``pickle-file``): a pickle that would create a marker file
  when loaded is planted in the newest generation; it is refused and never loaded;
- another run's generation (``run-mismatch``): a newer generation saved by a
  different run id into the store is skipped; the run's newest is restored;
- unsupported format version (``format-unsupported``): the newest generation's
  manifest claims a newer format (re-digested and, when the drill holds the signing
  key, re-signed, as a newer ckptvault would write it); asking for that step raises
  ``NoValidCheckpoint`` naming the rule, and a plain restore takes the previous one.

Checking the reason code, not only the generation restored, is what makes each
drill about its own protection: with the size check gone a truncated file is still
caught later (by its digests), but the drill says the first line of defence failed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from blake3 import blake3

from ckptvault.errors import NoValidCheckpoint
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.format.manifest import READABLE_FORMAT_VERSIONS, SELF_DIGEST_KEY
from ckptvault.ops.drills.base import Drill, DrillSkipped, has_code, timed_restore
from ckptvault.ops.drills.context import DrillContext
from ckptvault.storage.base import GenerationRef

Outcome = tuple[bool, str, dict[str, float]]
Damage = Callable[[DrillContext, Path, str], str]  # (context, generation dir, label) -> what


def _largest_data_file(generation: Path) -> Path:
    files = [p for p in generation.iterdir() if p.name not in (MANIFEST_NAME, SIGNATURE_NAME)]
    if not files:
        raise DrillSkipped(f"{generation.name} holds no data file to damage")
    return max(files, key=lambda p: (p.stat().st_size, p.name))


def _writable(path: Path) -> Path:
    """Published files are read-only; the drill's copy may be changed."""
    os.chmod(path, 0o644)
    return path


def _restore_expecting(
    context: DrillContext, label: str, store: Path, expected: GenerationRef, code: str, what: str
) -> Outcome:
    """Restore from ``store``: pass when ``expected`` is restored after skipping
    exactly one generation, for a reason carrying ``code``."""
    state, strict = context.new_state()
    with context.manager(store, label) as manager:
        outcome = timed_restore(manager, state, strict)
    reasons = outcome.skipped_reasons
    passed = (
        outcome.error is None
        and outcome.info is not None
        and outcome.info.generation_id == expected.generation_id
        and len(reasons) == 1
        and has_code(reasons[0], code)
    )
    return passed, f"{what}; {outcome.describe()}", outcome.timings


def _damage_newest(context: DrillContext, label: str, damage: Damage, code: str) -> Outcome:
    store = context.fresh_copy(label)
    refs = context.generations(store)
    if len(refs) < 2:
        raise DrillSkipped("the store holds one generation: there is nothing to fall back to")
    what = damage(context, Path(refs[0].location), label)
    return _restore_expecting(context, label, store, refs[1], code, what)


def _truncate(context: DrillContext, generation: Path, label: str) -> str:
    target = _writable(_largest_data_file(generation))
    size = target.stat().st_size
    os.truncate(target, size // 2)
    return f"truncated {target.name} of the newest generation from {size} to {size // 2} bytes"


def _flip(context: DrillContext, generation: Path, label: str) -> str:
    target = _writable(_largest_data_file(generation))
    offset = target.stat().st_size // 2  # past any header: tensor (or cipher) bytes
    with open(target, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    return f"flipped the byte at offset {offset} of {target.name} in the newest generation"


def _remove(context: DrillContext, generation: Path, label: str) -> str:
    target = _largest_data_file(generation)
    target.unlink()
    return f"removed {target.name} from the newest generation"


def marker_path(context: DrillContext, label: str) -> Path:
    """The file the planted pickle creates if anything ever loads it."""
    return context.workdir(label) / "pickle-was-loaded"


def _plant_pickle(context: DrillContext, generation: Path, label: str) -> str:
    marker = marker_path(context, label)
    # Protocol 0 by hand (nothing here imports pickle): open(marker, "w") when loaded.
    payload = f"c__builtin__\nopen\n(V{marker}\nVw\ntR.".encode()
    (generation / "extra.pkl").write_bytes(payload)
    return "planted extra.pkl (a pickle that creates a marker file when loaded)"


def _pickle_drill(context: DrillContext) -> Outcome:
    passed, observed, timings = _damage_newest(
        context, "extra-pickle", _plant_pickle, "pickle-file"
    )
    if marker_path(context, "extra-pickle").exists():
        return False, f"{observed}; THE PICKLE WAS LOADED (its marker file exists)", timings
    return passed, f"{observed}; the pickle was never loaded", timings


def _other_run_drill(context: DrillContext) -> Outcome:
    label = "other-run"
    store = context.fresh_copy(label)
    newest = context.generations(store)[0]
    other = f"{context.run_id}-other"
    # Another run writing into this store (a copied directory, a mistyped path): a
    # real generation of its own, newer than this run's, signed by the same key.
    options = {"run_id": other, "keystore": None, "ledger": context.workdir(label) / "other.db"}
    with context.manager(store, f"{label}-writer", **options) as writer:
        writer.save(newest.step + 1, context.state_to_save())
    what = f"saved step {newest.step + 1} as run {other!r} into the store"
    return _restore_expecting(context, label, store, newest, "run-mismatch", what)


def _rewrite_format_version(context: DrillContext, generation: Path) -> int:
    """Re-write a manifest as a newer format would: new version, self-digest, and
    signature (when the drill holds the signing key). Returns the version."""
    manifest_path = generation / MANIFEST_NAME
    raw = json.loads(manifest_path.read_bytes())
    raw.pop(SELF_DIGEST_KEY, None)
    version = max(READABLE_FORMAT_VERSIONS) + 1
    raw["format_version"] = version
    raw[SELF_DIGEST_KEY] = blake3(dumps_canonical(raw)).hexdigest()
    data = dumps_canonical(raw)
    _writable(manifest_path).write_bytes(data)
    if context.signing_key is not None:
        from ckptvault.trust.signing import MANIFEST_DOMAIN, load_private_key, sign

        signature = sign(load_private_key(context.signing_key), data, MANIFEST_DOMAIN)
        _writable(generation / SIGNATURE_NAME).write_bytes(signature)
    return version


def _format_drill(context: DrillContext) -> Outcome:
    label = "format-version"
    store = context.fresh_copy(label)
    refs = context.generations(store)
    if len(refs) < 2:
        raise DrillSkipped("the store holds one generation: there is nothing to fall back to")
    version = _rewrite_format_version(context, Path(refs[0].location))
    what = f"the newest manifest now says format_version {version}"
    state, strict = context.new_state()
    with context.manager(store, label) as manager:
        asked = timed_restore(manager, state, strict, step=refs[0].step)
    typed = isinstance(asked.error, NoValidCheckpoint) and any(
        has_code(reason, "format-unsupported") for reason in asked.skipped_reasons
    )
    what += f"; restore(step={refs[0].step}): {asked.describe()}"
    passed, observed, timings = _restore_expecting(
        context, label, store, refs[1], "format-unsupported", what
    )
    return passed and typed, observed, timings


DAMAGE_DRILLS = [
    Drill(
        "truncated-file",
        "newest generation skipped (size-mismatch), the previous one restored",
        lambda c: _damage_newest(c, "truncated-file", _truncate, "size-mismatch"),
    ),
    Drill(
        "flipped-byte",
        "newest generation skipped (digest-mismatch), the previous one restored",
        lambda c: _damage_newest(c, "flipped-byte", _flip, "digest-mismatch"),
    ),
    Drill(
        "missing-file",
        "newest generation skipped (file-missing), the previous one restored",
        lambda c: _damage_newest(c, "missing-file", _remove, "file-missing"),
    ),
    Drill(
        "extra-pickle",
        "newest generation skipped (pickle-file), the pickle never loaded, previous restored",
        _pickle_drill,
    ),
    Drill(
        "other-run",
        "a newer generation of another run skipped (run-mismatch), this run's newest restored",
        _other_run_drill,
    ),
    Drill(
        "format-version",
        "a newer format version refused (NoValidCheckpoint, format-unsupported), "
        "the previous generation restored",
        _format_drill,
    ),
]
