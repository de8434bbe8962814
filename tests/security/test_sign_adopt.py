"""Adopting signatures on an existing run (``ckptvault sign``): a run saved unsigned
is signed in place, generation by generation, each only after it verified
completely; then ``trusted_keys=`` restores it and falls back over its history. What
does not verify, is another run's, was abandoned, or carries another key's signature
is never signed (or re-signed) by accident."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint, StoreLockedError, UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.ops import sign_steps
from ckptvault.ops.signing.sign import sign_generations
from ckptvault.ops.signing.steps import ALREADY_SIGNED, FAILED, REFUSED, SIGNED, SKIPPED
from ckptvault.trust.signing import MANIFEST_DOMAIN, generate_keypair, load_private_key, sign
from support.common import only_tensor_file, run_cli, writable


def tensors(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 17, generator=generator), "b": torch.arange(step * 4.0)}


def empty(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(32, 17), "b": torch.zeros(step * 4)}


def save_run(store: Path, steps=(1, 2, 3), run_id: str = "r", **options) -> None:
    # Small digest chunks: a byte flipped near the end lies beyond the header's chunk,
    # so only hashing every byte (not the structure checks) finds it.
    with cv.CheckpointManager(store, run_id=run_id, chunk_size=1024, **options) as mgr:
        for step in steps:
            mgr.save(step, tensors(step))


def generation(store: Path, step: int) -> Path:
    (path,) = store.glob(f"step-{step:012d}.*")
    return path


def flip_a_byte(store: Path, step: int) -> None:
    data = writable(only_tensor_file(generation(store, step)))
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x01
    data.write_bytes(bytes(raw))


def outcomes(report) -> dict[int, str]:
    return {g.step: g.outcome for g in report.generations}


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    """Three key pairs: a, b and c."""
    pairs = {}
    for name in "abc":
        pairs[name] = (tmp_path / f"{name}.pem", tmp_path / f"{name}.pub")
        generate_keypair(*pairs[name])
    return pairs


def test_an_unsigned_run_adopts_signatures_and_keeps_its_history(store, tmp_path, keys):
    """The issue's scenario, through the real command: saved unsigned, then `ckptvault
    sign --all`; a generation damaged before signing is reported and left unsigned
    (exit 1) while the others are signed; then trusted_keys= restores the newest and
    falls back over the old history."""
    private, public = keys["a"]
    save_run(store, steps=(1, 2, 3, 4))
    flip_a_byte(store, 2)
    manifests = {step: (generation(store, step) / MANIFEST_NAME).read_bytes() for step in (1, 3, 4)}
    control = tmp_path / "control"
    ledger, log = control / "ledger.sqlite3", control / "audit.jsonl"

    result = run_cli(
        "sign", str(store), "--signing-key", str(private), "--all", "--ledger", str(ledger),
        "--json",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert {g["step"]: g["outcome"] for g in report["generations"]} == {
        4: SIGNED,
        3: SIGNED,
        2: FAILED,
        1: SIGNED,
    }
    failed = next(g for g in report["generations"] if g["step"] == 2)
    assert "digest-mismatch" in failed["detail"]
    assert not (generation(store, 2) / SIGNATURE_NAME).exists()
    for step, manifest in manifests.items():  # a signature beside the very same bytes
        assert (generation(store, step) / MANIFEST_NAME).read_bytes() == manifest
        assert (generation(store, step) / SIGNATURE_NAME).is_file()
    # The adoption is on record, beside the ledger given, with the key and generations.
    (entry,) = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "signed"]
    assert entry["key_id"] == report["key_id"] and entry["run_id"] == "r"
    assert [g["step"] for g in entry["generations"]] == [4, 3, 1] and entry["failed"] == 1

    def trusted(name: str) -> cv.CheckpointManager:
        return cv.CheckpointManager(
            store, run_id="r", trusted_keys=[public], ledger=tmp_path / name / "ledger.sqlite3"
        )

    with trusted("newest") as mgr:
        state = empty(4)
        info = mgr.restore(state)
        assert info is not None and info.step == 4 and info.signer == report["key_id"]
        assert all(torch.equal(state[k], v) for k, v in tensors(4).items())
    flip_a_byte(store, 4)  # damaged after signing: the signature covers its digests
    with trusted("fallback") as mgr:
        info = mgr.restore(empty(3))
        assert info is not None and info.step == 3 and [s.step for s in info.skipped] == [4]
    with trusted("oldest") as mgr:
        # Older steps than one that verifies (3) are rollbacks: asked for on purpose.
        with pytest.raises(NoValidCheckpoint, match="signature-missing"):
            mgr.restore(empty(2), allow_rollback_to=2)
        assert mgr.restore(empty(1), allow_rollback_to=1).step == 1


def test_signing_again_changes_nothing(store, keys):
    save_run(store, steps=(1, 2))
    first = sign_generations(store, keys["a"][0], every=True)
    assert first.ok and outcomes(first) == {2: SIGNED, 1: SIGNED}
    signatures = {p: p.read_bytes() for p in store.glob(f"step-*/{SIGNATURE_NAME}")}
    again = sign_generations(store, keys["a"][0], every=True)
    assert again.ok and outcomes(again) == {2: ALREADY_SIGNED, 1: ALREADY_SIGNED}
    assert {p: p.read_bytes() for p in store.glob(f"step-*/{SIGNATURE_NAME}")} == signatures
    # Without --step or --all: the newest only.
    save_run(store, steps=(3,))
    assert outcomes(sign_generations(store, keys["a"][0])) == {3: SIGNED}


def test_another_keys_signature_is_replaced_only_after_it_verifies(store, keys):
    """A careful operator's expectations: a generation signed by key A is not quietly
    re-signed with B; with --replace-signature it is, once A's signature verifies with
    a --trusted-key; a signature nobody can check is never replaced."""
    (a_private, a_public), (b_private, b_public), (_, c_public) = keys["a"], keys["b"], keys["c"]
    save_run(store, steps=(1, 2), signing_key=a_private)
    signed_by_a = {p: p.read_bytes() for p in store.glob(f"step-*/{SIGNATURE_NAME}")}

    refused = sign_generations(store, b_private, every=True)
    assert not refused.ok and outcomes(refused) == {2: REFUSED, 1: REFUSED}
    assert "--replace-signature" in refused.generations[0].detail
    with pytest.raises(UsageError, match="trusted_keys"):
        sign_generations(store, b_private, every=True, replace_signatures=True)
    unchecked = sign_generations(
        store, b_private, every=True, replace_signatures=True, trusted_keys=[c_public]
    )
    assert outcomes(unchecked) == {2: FAILED, 1: FAILED}
    assert "not among the trusted keys" in unchecked.generations[0].detail
    assert {p: p.read_bytes() for p in store.glob(f"step-*/{SIGNATURE_NAME}")} == signed_by_a

    replaced = sign_generations(
        store, b_private, every=True, replace_signatures=True, trusted_keys=[a_public]
    )
    assert replaced.ok and outcomes(replaced) == {2: SIGNED, 1: SIGNED}
    assert "replaced the signature by ed25519:" in replaced.generations[0].detail
    with cv.CheckpointManager(store, run_id="r", trusted_keys=[b_public]) as mgr:
        assert mgr.restore(empty(2)).step == 2


def test_a_signature_of_the_signing_key_that_does_not_match_is_not_signed_over(store, keys):
    """manifest.sig names the signing key but covers other bytes: the manifest was
    edited after signing (or the signature forged). Reported, never re-signed."""
    save_run(store, steps=(1,))
    forged = sign(load_private_key(keys["a"][0]), b"other bytes", MANIFEST_DOMAIN)
    (generation(store, 1) / SIGNATURE_NAME).write_bytes(forged)
    report = sign_generations(store, keys["a"][0], every=True)
    assert outcomes(report) == {1: FAILED} and "does not match" in report.generations[0].detail
    assert (generation(store, 1) / SIGNATURE_NAME).read_bytes() == forged


def test_a_manifest_swapped_after_verification_is_never_signed(store, keys, monkeypatch):
    """Whoever writes the store swaps the manifest between the check of every byte and
    the signature: the compare-and-swap on the verified bytes refuses to write."""
    save_run(store, steps=(1,))
    manifest = generation(store, 1) / MANIFEST_NAME
    planted = manifest.read_bytes().replace(b'"step":1', b'"step":1 ')
    real_check = sign_steps.check_digests

    def check_then_swap(*args, **kwargs):
        problems = real_check(*args, **kwargs)
        writable(manifest).write_bytes(planted)
        return problems

    monkeypatch.setattr(sign_steps, "check_digests", check_then_swap)
    report = sign_generations(store, keys["a"][0], every=True)
    assert outcomes(report) == {1: FAILED}
    assert "not the manifest that was verified" in report.generations[0].detail
    assert not (generation(store, 1) / SIGNATURE_NAME).exists()
    assert manifest.read_bytes() == planted


def test_several_runs_need_a_run_id_and_other_runs_are_skipped(store, keys):
    save_run(store, steps=(1,), run_id="mine")
    save_run(store, steps=(2,), run_id="theirs")
    with pytest.raises(UsageError, match=r"'mine', 'theirs'.*run_id=.*Nothing was signed"):
        sign_generations(store, keys["a"][0], every=True)
    assert not list(store.glob(f"step-*/{SIGNATURE_NAME}"))
    report = sign_generations(store, keys["a"][0], every=True, run_id="mine")
    assert report.ok and outcomes(report) == {2: SKIPPED, 1: SIGNED}
    assert "another run's" in report.generations[0].detail


def test_an_encrypted_run_is_signed_only_with_its_key_store(store, tmp_path, keys):
    """Its manifests are authenticated by a MAC under the run's key: without the key
    store that check cannot run, so nothing is signed."""
    keystore = tmp_path / "kek"
    save_run(store, steps=(1, 2), keystore=keystore)
    with pytest.raises(UsageError, match=r"encrypted.*keystore=.*Nothing was signed"):
        sign_generations(store, keys["a"][0], every=True)
    assert not list(store.glob(f"step-*/{SIGNATURE_NAME}"))
    report = sign_generations(store, keys["a"][0], every=True, keystore=keystore)
    assert report.ok and outcomes(report) == {2: SIGNED, 1: SIGNED}
    with cv.CheckpointManager(
        store, run_id="r", keystore=keystore, trusted_keys=[keys["a"][1]]
    ) as mgr:
        state = empty(2)
        assert mgr.restore(state).step == 2 and torch.equal(state["w"], tensors(2)["w"])


def test_generations_an_allowed_rollback_abandoned_are_not_signed(store, tmp_path, keys):
    ledger = tmp_path / "control" / "ledger.sqlite3"
    save_run(store, steps=(1, 2, 3), ledger=ledger)
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        assert mgr.restore(empty(3)).step == 3
        assert mgr.restore(empty(1), allow_rollback_to=1).step == 1  # abandons 2 and 3
    report = sign_generations(store, keys["a"][0], every=True, ledger=ledger)
    assert report.ok and outcomes(report) == {3: SKIPPED, 2: SKIPPED, 1: SIGNED}
    assert "abandoned" in report.generations[0].detail
    assert [p.parent.name[:17] for p in store.glob(f"step-*/{SIGNATURE_NAME}")] == [
        "step-000000000001"
    ]


def test_signing_waits_for_no_trainer(store, keys):
    save_run(store, steps=(1,))
    with cv.CheckpointManager(store, run_id="r") as trainer:
        trainer.save(2, tensors(2))  # a trainer that saved holds the store's writer lock
        with pytest.raises(StoreLockedError, match="between training jobs"):
            sign_generations(store, keys["a"][0], every=True)
    assert not list(store.glob(f"step-*/{SIGNATURE_NAME}"))


def test_a_signed_s3_run_restores_with_trusted_keys(s3_bucket, keys):
    url = f"s3://{s3_bucket}/run"
    save_run(url, steps=(1, 2))
    report = sign_generations(url, keys["a"][0], every=True)
    assert report.ok and outcomes(report) == {2: SIGNED, 1: SIGNED}
    with cv.CheckpointManager(url, run_id="r", trusted_keys=[keys["a"][1]]) as mgr:
        assert mgr.restore(empty(2)).step == 2
        assert mgr.restore(empty(1), allow_rollback_to=1).step == 1


def test_a_planted_generation_of_another_run_is_never_taken_for_the_run(store, keys):
    """Signing the newest (or one step) infers the run from the whole store, so a
    generation of another run planted as the newest is refused, not signed."""
    save_run(store, steps=(1, 2), run_id="mine")
    save_run(store, steps=(3,), run_id="evil")
    for step in (None, 3):
        with pytest.raises(UsageError, match=r"'evil', 'mine'.*Nothing was signed"):
            sign_generations(store, keys["a"][0], step=step)
    assert not list(store.glob(f"step-*/{SIGNATURE_NAME}"))
