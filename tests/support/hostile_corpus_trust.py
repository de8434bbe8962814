"""Corpus entries (see :mod:`hostile_corpus`): unsigned, forged, another run's and
rolled-back generations, and encrypted segments replayed from elsewhere, each in
formats 3 and 2 (a format-3 generation relabelled gets indexes naming it too, as an
attacker would write them)."""

from __future__ import annotations

import shutil

import ckptvault as cv
from ckptvault.errors import RollbackError
from support.common import make_training_state
from support.hostile_corpus import REPLAY, TRUST, hostile
from support.hostile_plants import (
    Plot,
    copy_generation,
    forge_manifest,
    generation_id,
    put_segment,
    remac,
    replace_bytes,
    resign,
    segment,
)

# -- trust: unsigned, forged, another run's, rolled back --------------------------------


@hostile(TRUST, "signed", "signature-missing", formats=(3, 2))
def signature_removed(plot: Plot) -> int:
    (plot.gen(2) / "manifest.sig").unlink()
    return 2


@hostile(TRUST, "signed", "signature-missing", restores=2, formats=(3, 2))
def unsigned_generation_planted_as_newer(plot: Plot) -> int:
    planted = copy_generation(plot.gen(2), plot.store, 3, "29990101T000000000000Z-0badc0de")
    (planted / "manifest.sig").unlink()
    forge_manifest(planted, lambda m: m.update(step=3, generation_id=generation_id(planted)))
    return 3


@hostile(TRUST, "signed", "signature-untrusted", formats=(3, 2))
def signed_by_another_key(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m["contract"].update(evil=True))
    resign(plot.gen(2), plot.key("stranger.pem"))
    return 2


@hostile(TRUST, "signed", "signature-invalid", formats=(3, 2))
def signature_of_another_manifest(plot: Plot) -> int:
    replace_bytes(plot.gen(2) / "manifest.sig", (plot.gen(1) / "manifest.sig").read_bytes())
    return 2


@hostile(TRUST, "signed", "signature-invalid", formats=(3, 2))
def manifest_edited_after_signing(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m["contract"].update(evil=True))
    return 2


@hostile(TRUST, "signed", "run-mismatch", restores=2, formats=(3, 2))
def generation_of_another_run(plot: Plot) -> int:
    other = plot.gen(3, plot.root / "other")  # signed by the same trainer key
    copy_generation(other, plot.store, 3, generation_id(other))
    return 3


@hostile(TRUST, "plain", "run-mismatch", formats=(3, 2))
def generation_of_another_run_unsigned(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m.update(run_id="other"))
    return 2


@hostile(TRUST, "signed", "signature-invalid", restores=2, formats=(3, 2))
def another_run_relabelled_as_this_one(plot: Plot) -> int:
    other = plot.gen(3, plot.root / "other")
    planted = copy_generation(other, plot.store, 3, generation_id(other))
    forge_manifest(planted, lambda m: m.update(run_id="r"))
    return 3


@hostile(TRUST, "signed", "name-mismatch", restores=2, formats=(3, 2))
def older_generation_republished_as_newer(plot: Plot) -> int:
    copy_generation(plot.gen(1), plot.store, 3, "29990101T000000000000Z-0badc0de")
    return 3


@hostile(TRUST, "signed", "signature-invalid", restores=2, formats=(3, 2))
def older_generation_relabelled_as_newer(plot: Plot) -> int:
    planted = copy_generation(plot.gen(1), plot.store, 3, "29990101T000000000000Z-0badc0de")
    forge_manifest(planted, lambda m: m.update(step=3, generation_id=generation_id(planted)))
    return 3


@hostile(TRUST, "encrypted", "manifest-unauthenticated", restores=2, formats=(3, 2))
def encrypted_generation_relabelled_as_newer(plot: Plot) -> int:
    source = plot.gen(1)
    planted = copy_generation(source, plot.store, 3, generation_id(source))
    forge_manifest(planted, lambda m: m.update(step=3))
    return 3


# -- the floor: a step the run already moved past ----------------------------------------


@hostile(TRUST, "signed", "rollback", restores=None, refusal=RollbackError, formats=(3, 2))
def step_below_the_floor(plot: Plot) -> int:
    """The run restored step 2 (the floor); then step 2 is hidden from the store, so
    only step 1, validly signed, is offered."""
    with cv.CheckpointManager(plot.store, **plot.options()) as mgr:
        assert mgr.restore(make_training_state(seed=5)).step == 2
    shutil.move(plot.gen(2), plot.outside / plot.gen(2).name)
    return 1


# -- encrypted segments replayed from another place --------------------------------------


def _replay(plot: Plot, source: bytes, index: int, key_holder: bool) -> int:
    put_segment(plot.tensor_file(2), index, source)
    forge_manifest(plot.gen(2))  # digests refreshed: only the MAC and AES-GCM remain
    if key_holder:
        assert plot.keystore is not None
        remac(plot.gen(2), plot.keystore)  # past the MAC: only AES-GCM remains
    return 2


@hostile(REPLAY, "encrypted", "manifest-unauthenticated", formats=(3, 2))
def segments_swapped_without_the_key(plot: Plot) -> int:
    file = plot.tensor_file(2)
    first, second = segment(file, 0), segment(file, 1)
    put_segment(file, 1, first)
    return _replay(plot, second, 0, key_holder=False)


@hostile(REPLAY, "encrypted", "authentication-failed", formats=(3, 2))
def segments_swapped_within_a_file(plot: Plot) -> int:
    file = plot.tensor_file(2)
    first, second = segment(file, 0), segment(file, 1)
    put_segment(file, 1, first)
    return _replay(plot, second, 0, key_holder=True)


@hostile(REPLAY, "encrypted", "authentication-failed", formats=(3, 2))
def segment_repeated_at_another_position(plot: Plot) -> int:
    return _replay(plot, segment(plot.tensor_file(2), 1), 0, key_holder=True)


@hostile(REPLAY, "encrypted", "authentication-failed", formats=(3, 2))
def segment_replayed_from_an_older_generation(plot: Plot) -> int:
    return _replay(plot, segment(plot.tensor_file(1), 0), 0, key_holder=True)


@hostile(REPLAY, "encrypted", "authentication-failed", formats=(3, 2))
def segment_replayed_from_the_state_file(plot: Plot) -> int:
    return _replay(plot, segment(plot.state_file(2), 0), 0, key_holder=True)


@hostile(REPLAY, "encrypted", "authentication-failed", formats=(3, 2))
def whole_file_replayed_from_an_older_generation(plot: Plot) -> int:
    replace_bytes(plot.tensor_file(2), plot.tensor_file(1).read_bytes())
    forge_manifest(plot.gen(2))
    assert plot.keystore is not None
    remac(plot.gen(2), plot.keystore)
    return 2


@hostile(REPLAY, "encrypted", "key-unavailable", formats=(3, 2))
def wrapped_key_replayed_from_an_older_generation(plot: Plot) -> int:
    name = plot.tensor_file(2).name
    older = plot.manifest(1)["encryption"]["files"][name]
    forge_manifest(plot.gen(2), lambda m: m["encryption"]["files"].update({name: older}))
    assert plot.keystore is not None
    remac(plot.gen(2), plot.keystore)
    return 2


@hostile(REPLAY, "encrypted", "manifest-unauthenticated", formats=(3, 2))
def manifest_mac_replayed_from_an_older_generation(plot: Plot) -> int:
    mac = plot.manifest(1)["encryption"]["manifest_mac"]
    forge_manifest(plot.gen(2), lambda m: m["encryption"].update(manifest_mac=mac))
    return 2
