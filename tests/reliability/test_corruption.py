"""Corruption: any single flipped byte of a small generation is detected, 100%.

The exhaustive sweep (issue 13): every byte of the manifest (format 3's root; and a
planted format-2 manifest, which the reader still accepts), of each per-rank index
(format 3), of ``manifest.sig`` and of each tensor file's header (length prefix and
JSON), the tensor data, and every byte of an encrypted generation's containers,
flipped one at a time with several patterns. After each flip ``verify`` must report the generation, restore must refuse
it with ``NoValidCheckpoint`` where it is alone (leaving the state untouched) and
fall back bit-exactly to the older good generation beside it (reporting the skip);
see ``corruption_sweep``. ``make test`` runs a sample (the first and last byte of
every region with every pattern, plus random ones; the seed is printed,
``CKPTVAULT_CORRUPTION_SEED`` replays it); ``make reliability`` flips every byte
of every manifest, index, signature and tensor header once (the patterns taking turns), and 3,000
sampled flips each of tensor data and encrypted containers (every byte of those
took over an hour). Targeted tamper tests live in test_restore.py,
test_hostile_inputs.py and test_encryption.py; ``ckptvault verify`` on flipped bytes
in test_corruption_cli.py; this is the sweep.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.errors import CheckpointError, FormatError, NoValidCheckpoint
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.manifest import parse_manifest
from ckptvault.trust.envelope import SegmentDecryptor, binding
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.signing import generate_keypair, parse_signature
from support.common import run_cli
from support.corruption_sweep import (
    EVERY_BIT,
    PATTERNS,
    RUN,
    Flip,
    Region,
    Sweep,
    build_sweep,
    choose_flips,
    failure_report,
    run_flip,
    small_state,
    sweep_detail,
    tensor_file_regions,
    train,
    whole_file,
)
from support.hostile_forging import write_index, writer_format
from support.reliability import record

pytestmark = pytest.mark.reliability


def seeded() -> tuple[int, random.Random]:
    seed = int(os.environ.get("CKPTVAULT_CORRUPTION_SEED", str(time.time_ns() % 2**32)))
    print(f"corruption sweep seed {seed} (replay with CKPTVAULT_CORRUPTION_SEED={seed})")
    return seed, random.Random(seed)


def sweep_scenario(
    scenario: str,
    sweep: Sweep,
    regions: list[Region],
    patterns: tuple[int, ...],
    ci: int,
    long_cap: int | None = None,
    reseal: Callable[[Path, str], None] | None = None,
) -> None:
    seed, rng = seeded()
    flips = choose_flips(regions, patterns, ci, rng, long_cap)
    for flip in flips:
        run_flip(sweep, flip, reseal)
    record(scenario, sweep.trials, len(sweep.failures), sweep_detail(sweep, seed, flips))
    assert not sweep.failures, failure_report(sweep, seed)
    assert sweep.trials == len(flips) > 0


@pytest.fixture(autouse=True)
def quiet_fallbacks(caplog: pytest.LogCaptureFixture) -> None:
    """Each fallback logs a warning; thousands of them say nothing the checks don't."""
    caplog.set_level(logging.ERROR, logger="ckptvault")


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    generate_keypair(tmp_path / "trainer.pem", tmp_path / "trainer.pub")
    return {"private": tmp_path / "trainer.pem", "public": tmp_path / "trainer.pub"}


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where a sweep's stores and control-plane state (ledger, audit log, catalog)
    live: on tmpfs where there is one. The sweep checks detection, not durability,
    and every restore records a reader lease and a catalog entry with fsyncs, which
    on a loaded disk cost more than all the checks."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    place = Path(tempfile.mkdtemp(prefix="ckptvault-corruption-", dir=shm))
    monkeypatch.setenv("XDG_STATE_HOME", str(place / "state"))
    try:
        yield place
    finally:
        shutil.rmtree(place, ignore_errors=True)


@pytest.fixture
def plain(root: Path) -> Iterator[Sweep]:
    """Unsigned, unencrypted, no ledger: only the manifest's self-digest and the
    file digests stand between a flipped byte and a restore."""
    sweep = build_sweep(root, lambda _name: {})
    yield sweep
    sweep.close()


@pytest.fixture
def plain_format_2(root: Path) -> Iterator[Sweep]:
    """As ``plain``, written in format 2 (one manifest holding every chunk digest and
    chunk): an attacker can plant that format, so its manifest must be as tight."""
    with writer_format(2):
        sweep = build_sweep(root, lambda _name: {})
    assert json.loads((sweep.target / "manifest.json").read_bytes())["format_version"] == 2
    yield sweep
    sweep.close()


@pytest.fixture
def encrypted(root: Path) -> Iterator[Sweep]:
    """Encrypted, unsigned: digests, the manifest's MAC and AES-GCM."""
    keystore = root / "keys"
    sweep = build_sweep(root, lambda _name: {"keystore": keystore, "segment_size": 4096})
    yield sweep
    sweep.close()


@pytest.fixture
def signed(root: Path, keys: dict[str, Path]) -> Iterator[Sweep]:
    """Signed and checked against the trusted key; each store has its own ledger."""

    def options(name: str) -> dict:
        return {
            "signing_key": keys["private"],
            "trusted_keys": [keys["public"]],
            "ledger": root / f"{name}-ledger" / "ledger.sqlite3",
        }

    sweep = build_sweep(root, options)
    yield sweep
    sweep.close()


def tensor_files(sweep: Sweep) -> list[Path]:
    files = sorted(sweep.target.glob("*.safetensors"))
    assert files
    return files


def index_files(sweep: Sweep) -> list[Region]:
    """Every byte of the target's indexes (one per rank that wrote a file)."""
    indexes = sorted(sweep.target.glob("*-index.json"))
    assert indexes, "a format-3 generation has an index per rank"
    return [whole_file(index) for index in indexes]


# -- an unsigned, unencrypted generation ----------------------------------------------


def test_every_manifest_byte_flip_is_detected(plain: Sweep) -> None:
    manifest = whole_file(plain.target / "manifest.json")
    sweep_scenario("corruption: manifest bytes", plain, [manifest], PATTERNS, ci=90)


def test_every_index_byte_flip_is_detected(plain: Sweep) -> None:
    """The root records each index's size and digest: a flipped index byte is found
    before the index is parsed, whatever the byte was (a chunk digest, a chunk's
    offset, the run it names)."""
    sweep_scenario("corruption: index bytes", plain, index_files(plain), PATTERNS, ci=90)


def record_index(generation: Path, name: str) -> None:
    """An attacker's rewrite after editing index ``name``: the root records its new
    size and digest (and its self-digest is recomputed)."""
    write_index(generation, name, (generation / name).read_bytes())


def test_every_index_byte_flip_behind_a_refreshed_record_is_detected(plain: Sweep) -> None:
    """Unsigned, anyone can record the flipped index in the root: then what the index
    says must be caught (its chunk digests, its chunks, what it names), byte by byte."""
    sweep_scenario(
        "corruption: index bytes behind a refreshed record",
        plain,
        index_files(plain),
        PATTERNS,
        ci=60,
        reseal=record_index,
    )


def test_every_format_2_manifest_byte_flip_is_detected(plain_format_2: Sweep) -> None:
    manifest = whole_file(plain_format_2.target / "manifest.json")
    sweep_scenario(
        "corruption: format-2 manifest bytes", plain_format_2, [manifest], PATTERNS, ci=40
    )


def test_every_tensor_header_byte_flip_is_detected(plain: Sweep) -> None:
    headers = [tensor_file_regions(file)[0] for file in tensor_files(plain)]
    sweep_scenario("corruption: tensor headers", plain, headers, PATTERNS, ci=60)


def test_tensor_data_byte_flips_are_detected(plain: Sweep) -> None:
    data = [tensor_file_regions(file)[1] for file in tensor_files(plain)]
    sweep_scenario("corruption: tensor data", plain, data, PATTERNS, ci=40, long_cap=3000)


# -- an encrypted generation ----------------------------------------------------------


def test_encrypted_manifest_byte_flips_are_detected(encrypted: Sweep) -> None:
    manifest = whole_file(encrypted.target / "manifest.json")
    sweep_scenario("corruption: encrypted manifest bytes", encrypted, [manifest], PATTERNS, ci=40)


def test_encrypted_index_byte_flips_are_detected(encrypted: Sweep) -> None:
    """An encrypted generation's indexes are plaintext, covered by the root's digest
    of them (and through it by the root's MAC)."""
    sweep_scenario(
        "corruption: encrypted index bytes", encrypted, index_files(encrypted), PATTERNS, ci=30
    )


def test_encrypted_container_byte_flips_are_detected(encrypted: Sweep) -> None:
    containers = [whole_file(f) for f in sorted(encrypted.target.glob("*.enc"))]
    assert {f.file.endswith("-state.json.enc") for f in containers} == {True, False}
    sweep_scenario(
        "corruption: encrypted containers", encrypted, containers, PATTERNS, ci=70, long_cap=3000
    )


def _decrypt(data: bytes, key: bytes, context: bytes, name: str) -> bytes:
    plain = bytearray()
    decryptor = SegmentDecryptor(key, context, name, lambda _offset, piece: plain.extend(piece))
    decryptor.feed(data)
    decryptor.finish()
    return bytes(plain)


def test_aes_gcm_alone_catches_every_container_flip(store: Path, tmp_path: Path) -> None:
    """The digests catch a flipped ciphertext byte first; this takes them away and
    decrypts the flipped container directly: the segments' AES-GCM tags (and the
    container header's checks) must catch every flip on their own."""
    state = small_state(seed=0)
    train(state, 2)
    keystore = tmp_path / "keys"
    with cv.CheckpointManager(store, run_id=RUN, keystore=keystore, segment_size=4096) as mgr:
        generation = Path(mgr.save(1, state).result().path)
    manifest = parse_manifest((generation / "manifest.json").read_bytes(), "sweep")
    assert manifest.encryption is not None
    opened: dict[str, tuple[bytes, bytes, bytes]] = {}  # name -> (bytes, key, context)
    for name, wrapped in manifest.encryption.wrapped_keys.items():
        context = binding(RUN, manifest.generation_id, name)
        key = LocalKeyStore(keystore).unwrap(RUN, manifest.encryption.kek_id, wrapped, context)
        opened[name] = ((generation / name).read_bytes(), key, context)
        _decrypt(opened[name][0], key, context, name)  # the pristine container opens
    seed, rng = seeded()
    regions = [Region(name, 0, len(data)) for name, (data, _, _) in sorted(opened.items())]
    flips = choose_flips(regions, PATTERNS, 2000, rng)
    failures, caught = _decrypt_flipped(opened, flips)
    detail = f"seed {seed}; caught by: {dict(caught)}"
    record("corruption: encrypted containers, AES-GCM alone", len(flips), len(failures), detail)
    assert not failures, f"seed {seed}: " + "\n".join(failures[:20])


def _decrypt_flipped(
    opened: dict[str, tuple[bytes, bytes, bytes]], flips: list[Flip]
) -> tuple[list[str], Counter[str]]:
    failures: list[str] = []
    caught: Counter[str] = Counter()
    for flip in flips:
        data, key, context = opened[flip.file]
        flipped = bytearray(data)
        flipped[flip.offset] ^= flip.pattern
        try:
            _decrypt(bytes(flipped), key, context, flip.file)
        except CheckpointError as exc:
            caught[type(exc).__name__] += 1
        except Exception as exc:
            failures.append(f"{flip}: untyped {type(exc).__name__}: {exc}")
        else:
            failures.append(f"{flip}: decrypted without complaint")
    return failures, caught


# -- a signed generation --------------------------------------------------------------


def test_every_signature_byte_flip_is_detected(signed: Sweep) -> None:
    """Every single-bit flip, not only three patterns: base64 leaves low bits of the
    last character unused, and a flip there must not pass for the same signature."""
    signature = whole_file(signed.target / "manifest.sig")
    # Long budget: every byte with every bit (a cap no sweep reaches), ~1,900 flips.
    sweep_scenario("corruption: signature", signed, [signature], EVERY_BIT, ci=70, long_cap=10**9)


def test_signed_manifest_byte_flips_are_detected(signed: Sweep) -> None:
    manifest = whole_file(signed.target / "manifest.json")
    sweep_scenario("corruption: signed manifest bytes", signed, [manifest], PATTERNS, ci=30)


def test_signed_index_byte_flips_are_detected(signed: Sweep) -> None:
    sweep_scenario("corruption: signed index bytes", signed, index_files(signed), PATTERNS, ci=30)


def _non_canonical_spelling(encoded: str) -> str:
    """The same signature bytes in other base64: the last data character before the
    padding carries 2 bits of the signature and 4 unused ones; set the lowest."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    head, last, pad = encoded[:-3], encoded[-3], encoded[-2:]
    assert pad == "==", encoded
    spelled = head + alphabet[alphabet.index(last) ^ 0x01] + pad
    assert spelled != encoded and base64.b64decode(spelled) == base64.b64decode(encoded)
    return spelled


def test_signature_in_non_canonical_base64_is_refused(
    store: Path, tmp_path: Path, keys: dict[str, Path]
) -> None:
    """Regression: ``manifest.sig`` took any base64 spelling of the signature, so a
    flipped bit in its last character verified as before (found by the sweep)."""
    options = {"signing_key": keys["private"], "ledger": tmp_path / "ledger" / "l.sqlite3"}
    with cv.CheckpointManager(store, run_id=RUN, **options) as mgr:
        generation = Path(mgr.save(1, small_state(seed=0)).result().path)
    sig = generation / "manifest.sig"
    document = json.loads(sig.read_bytes())
    document["signature"] = _non_canonical_spelling(document["signature"])
    sig.chmod(0o644)
    sig.write_bytes(dumps_canonical(document))
    with pytest.raises(FormatError, match="canonical base64"):
        parse_signature(sig.read_bytes(), "manifest.sig")
    for trusted, code in (([keys["public"]], "signature-invalid"), (None, "unknown-format")):
        with (
            cv.CheckpointManager(store, run_id=RUN, trusted_keys=trusted, **options) as mgr,
            pytest.raises(NoValidCheckpoint) as raised,
        ):
            mgr.restore(small_state(seed=7))
        assert [reason.split(":")[0] for _, _, reason in raised.value.rejected] == [code]
    result = run_cli("verify", str(store), "--trusted-key", str(keys["public"]), "--json")
    assert result.returncode == 1, result.stderr
    (report,) = json.loads(result.stdout)
    assert [p["code"] for p in report["problems"]] == ["signature-invalid"]
