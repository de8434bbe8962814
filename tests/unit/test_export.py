"""Weights-only export: one entry's tensors, cast when asked (never integer or bool
buffers), tied weights handled, stock safetensors reads it, signature verifies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptvault as cv
from ckptvault.errors import IntegrityError, SignatureError
from ckptvault.ops.export import export_weights
from ckptvault.ops.export_manifest import verify_export
from ckptvault.trust.signing import generate_keypair
from support.common import run_cli, writable


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("mask", torch.tensor([True, False, True]))


@pytest.fixture
def trained(store: Path, tmp_path: Path):
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters())
    model.norm(torch.randn(4, 16))  # num_batches_tracked -> 1
    state = {"model": model, "optimizer": opt, "rng": cv.RNGState(), "meta": {"step": 3}}
    with cv.CheckpointManager(store, run_id="lm", signing_key=tmp_path / "k.pem") as mgr:
        mgr.save(3, state)
    return model


def test_export_casts_floats_only_and_keeps_tied_weights(store, tmp_path, trained):
    out = tmp_path / "export" / "model.safetensors"
    result = export_weights(store, 3, out, dtype="bf16")
    assert result.step == 3 and result.run_id == "lm" and result.manifest_path is None
    loaded = load_file(out)  # stock safetensors
    expected = trained.state_dict()
    assert set(loaded) == set(expected)  # the model and nothing else
    for name, value in expected.items():
        if value.is_floating_point():
            assert loaded[name].dtype == torch.bfloat16
            assert torch.equal(loaded[name], value.to(torch.bfloat16))
        else:
            assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value)
    assert loaded["norm.num_batches_tracked"].dtype == torch.int64
    assert loaded["mask"].dtype == torch.bool
    assert torch.equal(loaded["head.weight"], loaded["embed.weight"])
    fresh = TiedLM()
    fresh.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in loaded.items()})


def test_signed_export_verifies_and_detects_tampering(store, tmp_path, trained):
    out = tmp_path / "model.safetensors"
    result = run_cli(
        "export",
        str(store),
        "--step",
        "3",
        "--out",
        str(out),
        "--signing-key",
        str(tmp_path / "k.pem"),
        "--trusted-key",
        str(tmp_path / "k.pub"),
    )
    assert result.returncode == 0, result.stderr
    check = verify_export(out, [tmp_path / "k.pub"])
    assert check.source["run_id"] == "lm" and check.source["step"] == 3
    assert (
        run_cli("verify-export", str(out), "--trusted-key", str(tmp_path / "k.pub")).returncode == 0
    )
    generate_keypair(tmp_path / "other.pem", tmp_path / "other.pub")
    with pytest.raises(SignatureError):
        verify_export(out, [tmp_path / "other.pub"])
    data = bytearray(out.read_bytes())
    data[-3] ^= 1
    writable(out).write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        verify_export(out, [tmp_path / "k.pub"])
    failed = run_cli("verify-export", str(out), "--trusted-key", str(tmp_path / "k.pub"))
    assert failed.returncode == 2 and "does not match" in failed.stderr


def test_export_reads_through_the_restore_checks(store, tmp_path, trained):
    generate_keypair(tmp_path / "stranger.pem", tmp_path / "stranger.pub")
    with pytest.raises(cv.errors.NoValidCheckpoint, match="signature-untrusted"):
        export_weights(
            store, 3, tmp_path / "x.safetensors", trusted_keys=[tmp_path / "stranger.pub"]
        )
    export_weights(store, 3, tmp_path / "y.safetensors", trusted_keys=[tmp_path / "k.pub"])
    with pytest.raises(cv.errors.UsageError, match="no entry 'weights'"):
        export_weights(store, 3, tmp_path / "z.safetensors", key="weights")


def test_export_from_an_encrypted_run(tmp_path):
    from ckptvault.trust.keystore import LocalKeyStore

    store, keys = tmp_path / "store", tmp_path / "keys"
    model = torch.nn.Linear(4, 4)
    with cv.CheckpointManager(store, run_id="enc", keystore=keys) as mgr:
        mgr.save(1, {"model": model})
    with pytest.raises(cv.errors.NoValidCheckpoint, match="key-unavailable"):
        export_weights(store, 1, tmp_path / "a.safetensors")
    export_weights(store, 1, tmp_path / "b.safetensors", keystore=LocalKeyStore(keys))
    assert torch.equal(load_file(tmp_path / "b.safetensors")["weight"], model.weight.detach())
    result = run_cli(
        "export",
        str(store),
        "--step",
        "1",
        "--out",
        str(tmp_path / "c.safetensors"),
        "--keystore",
        str(keys),
    )
    assert result.returncode == 0, result.stderr


def test_export_is_audited(store, tmp_path, trained, isolated_state_dir):
    """With a trust option (here --trusted-key), as for a save; without one an export
    writes no audit log (tests/security/test_control_plane_paths.py)."""
    import json

    assert (
        run_cli(
            "export", str(store), "--step", "3", "--out", str(tmp_path / "m.safetensors"),
            "--trusted-key", str(tmp_path / "k.pub"),
        ).returncode
        == 0
    )  # fmt: skip
    entries = [
        json.loads(line) for line in (isolated_state_dir / "audit.jsonl").read_text().splitlines()
    ]
    assert entries[-1]["event"] == "export" and entries[-1]["step"] == 3


def test_export_refuses_ambiguity_between_runs(tmp_path):
    store = tmp_path / "store"
    with cv.CheckpointManager(store, run_id="mine") as mgr:
        mgr.save(5, {"model": torch.nn.Linear(2, 2)})
    with cv.CheckpointManager(store, run_id="theirs") as mgr:
        mgr.save(5, {"model": torch.nn.Linear(2, 2)})
    with pytest.raises(cv.errors.UsageError, match="mine, theirs"):
        export_weights(store, 5, tmp_path / "a.safetensors")
    result = export_weights(store, 5, tmp_path / "b.safetensors", run_id="mine")
    assert result.run_id == "mine"


def test_a_bad_signing_key_leaves_the_previous_export_intact(store, tmp_path, trained):
    out = tmp_path / "model.safetensors"
    trusted = [tmp_path / "k.pub"]
    export_weights(store, 3, out, signing_key=tmp_path / "k.pem", trusted_keys=trusted)
    before = out.read_bytes()
    (tmp_path / "broken.pem").write_text("not a key")
    with pytest.raises(cv.errors.UsageError, match=r"broken\.pem"):
        export_weights(
            store, 3, out, dtype="fp16", signing_key=tmp_path / "broken.pem", trusted_keys=trusted
        )
    assert out.read_bytes() == before
    verify_export(out, [tmp_path / "k.pub"])
    export_weights(store, 3, out, dtype="fp16")  # unsigned: the old manifest must go
    with pytest.raises(cv.errors.FormatError, match="no signed export manifest"):
        verify_export(out, [tmp_path / "k.pub"])


def test_a_refused_export_leaves_the_previous_release_and_its_manifest_intact(
    store, tmp_path, trained
):
    """Red-team finding (round 3): a re-export over an existing signed release that is
    refused (the source no longer verifies) removed the release's signed manifest."""
    out = tmp_path / "model.safetensors"
    trusted = [tmp_path / "k.pub"]
    export_weights(store, 3, out, signing_key=tmp_path / "k.pem", trusted_keys=trusted)
    before = out.read_bytes()
    data_file = max(
        (p for p in next(store.glob("step-*")).iterdir() if p.name.endswith(".safetensors")),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(data_file.read_bytes())
    data[-5] ^= 0xFF
    writable(data_file).write_bytes(bytes(data))
    with pytest.raises(cv.errors.NoValidCheckpoint):
        export_weights(store, 3, out, signing_key=tmp_path / "k.pem", trusted_keys=trusted)
    assert out.read_bytes() == before
    assert verify_export(out, trusted).source["step"] == 3
