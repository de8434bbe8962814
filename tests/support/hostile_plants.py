"""The ground a hostile generation is planted on, and the attacker's tools.

A :class:`Bases` builds, once per test, small stores of run ``"r"`` with two good
generations each (steps 1 and 2): ``plain`` (no trust features), ``signed`` (signed
by the trainer's key, trusted keys and a ledger on; beside it a store of run
``"other"`` signed by the same key) and ``encrypted`` (a key store, 4 KiB segments
so that every file has several), each written in the current format (3: a root
manifest over one index per rank). ``plain-f2``, ``signed-f2`` and ``encrypted-f2``
are the same written in format 2 (one manifest with every chunk): the reader still
accepts that format, so an attacker can plant it, and its defences stay tested.
Each corpus entry gets its own copy, a :class:`Plot`, with a directory ``outside``
the store holding a secret file that no reader may open, and a marker path that a
pickle payload would create.

The tools are an attacker's: someone who can write the store, holding no signing
key and no key-encryption key, who refreshes the manifest's digests and self-digest
after an edit (:mod:`hostile_forging`) so that the attack reaches the parser behind
them. :func:`remac` and :func:`resign` are an insider's (the run's key, the
trainer's key): they let an entry reach the checks behind the MAC and the signature.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import shlex
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ckptvault as cv
from ckptvault.format.manifest import authenticated_bytes
from ckptvault.trust.envelope import manifest_key_binding
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.manifest_auth import manifest_mac
from ckptvault.trust.signing import MANIFEST_DOMAIN, generate_keypair, load_private_key, sign
from support.common import make_training_state, model_snapshot, train_steps, writable
from support.hostile_forging import (
    forge_index,
    forge_manifest,
    forge_root,
    reseal,
    writer_format,
)

__all__ = ["Bases", "Plot", "forge_index", "forge_manifest", "forge_root"]

SEGMENT = 4096
MANIFEST = "manifest.json"
SECRET = b"TOP SECRET: nothing outside the store may be read\n" * 40


@dataclass
class Plot:
    """One entry's copy of a base: ``root`` holds ``store``, ``control`` (ledger,
    audit log), ``keys`` (trainer/stranger key pairs), ``keystore`` (encrypted base),
    ``other`` (run "other", signed base) and ``outside`` (the secrets)."""

    base: str  # "plain", "signed" or "encrypted", with "-f2" for format 2
    root: Path

    @property
    def kind(self) -> str:
        """The base's trust features: "plain", "signed" or "encrypted"."""
        return self.base.split("-")[0]

    @property
    def format(self) -> int:
        """The format its generations are written in."""
        return 2 if self.base.endswith("-f2") else 3

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def keystore(self) -> Path | None:
        return self.root / "keystore" if self.kind == "encrypted" else None

    @property
    def outside(self) -> Path:
        return self.root / "outside"

    @property
    def secret(self) -> Path:
        return self.outside / "secret.bin"

    @property
    def marker(self) -> Path:
        return self.root / "pwned"  # what a pickle payload would create

    def key(self, name: str) -> Path:
        return self.root / "keys" / name

    @property
    def trusted(self) -> list[Path] | None:
        return [self.key("trainer.pub")] if self.kind == "signed" else None

    def gen(self, step: int, store: Path | None = None) -> Path:
        (path,) = sorted((store or self.store).glob(f"step-{step:012d}.*"))
        return path

    def tensor_file(self, step: int) -> Path:
        (path,) = sorted(self.gen(step).glob("*.safetensors*"))
        return path

    def index(self, step: int, holder: int = 0) -> Path:
        """Rank ``holder``'s index of step ``step`` (format 3)."""
        return self.gen(step) / f"r{holder:05d}-index.json"

    def state_file(self, step: int) -> Path:
        (path,) = sorted(self.gen(step).glob("*-state.json.enc"))
        return path

    def manifest(self, step: int) -> dict[str, Any]:
        return json.loads((self.gen(step) / "manifest.json").read_bytes())

    def options(self) -> dict[str, Any]:
        """What the trainer passes to CheckpointManager for this base."""
        options: dict[str, Any] = {"run_id": "r"}
        if self.kind != "plain":  # the ledger and the audit log beside it, in the control plane
            options.update(
                ledger=self.control / "ledger.sqlite3", audit_log=self.control / "audit.jsonl"
            )
        if self.kind == "signed":
            options.update(trusted_keys=self.trusted)
        if self.kind == "encrypted":
            options.update(keystore=self.keystore)
        return options

    def allowed(self) -> list[Path]:
        """Where readers may look: the store and the control plane."""
        return [self.store, self.control, self.root / "keystore", self.root / "keys"]


@dataclass
class Bases:
    """The base stores (built on first use) and their steps' model weights."""

    directory: Path
    weights: dict[str, dict[int, dict[str, torch.Tensor]]] = field(default_factory=dict)

    def plot(self, base: str, name: str) -> Plot:
        source = self.directory / base
        if not source.exists():
            self._build(base, source)
        plot = Plot(base, self.directory / "plots" / name)
        shutil.copytree(source, plot.root, symlinks=True)
        plot.outside.mkdir()
        plot.control.mkdir(exist_ok=True)
        plot.secret.write_bytes(SECRET)
        return plot

    def _build(self, base: str, root: Path) -> None:
        plot = Plot(base, root)
        (root / "keys").mkdir(parents=True)
        for who in ("trainer", "stranger"):
            generate_keypair(plot.key(f"{who}.pem"), plot.key(f"{who}.pub"))
        options = plot.options()
        if plot.kind == "signed":
            options["signing_key"] = plot.key("trainer.pem")
        if plot.kind == "encrypted":
            options["segment_size"] = SEGMENT
        state = make_training_state()
        with writer_format(plot.format), cv.CheckpointManager(plot.store, **options) as mgr:
            for step in (1, 2):
                train_steps(state, 1)
                self.weights.setdefault(base, {})[step] = model_snapshot(state["model"])
                mgr.save(step, state)
        if plot.kind == "signed":  # another run, signed by the same trainer key
            other = {**options, "run_id": "other"}
            with writer_format(plot.format), cv.CheckpointManager(root / "other", **other) as mgr:
                mgr.save(3, make_training_state(seed=4))
        assert {json.loads(m.read_bytes())["format_version"] for m in root.rglob(MANIFEST)} == {
            plot.format
        }


# -- the attacker's tools ---------------------------------------------------------------


def replace_bytes(file: Path, data: bytes) -> None:
    writable(file).write_bytes(data)


def resign(generation: Path, private_key: Path) -> None:
    """Sign the generation's manifest bytes as they are now (an insider's tool)."""
    signature = sign(
        load_private_key(private_key), (generation / "manifest.json").read_bytes(), MANIFEST_DOMAIN
    )
    replace_bytes(generation / "manifest.sig", signature)


def remac(generation: Path, keystore: Path) -> None:
    """Recompute an encrypted manifest's MAC with the run's key (an insider's tool),
    so that an entry reaches the AES-GCM checks behind it."""
    document = json.loads((generation / "manifest.json").read_bytes())
    section = document["encryption"]
    mac_key = LocalKeyStore(keystore).unwrap(
        document["run_id"],
        section["kek_id"],
        base64.b64decode(section["wrapped_mac_key"]),
        manifest_key_binding(document["run_id"], document["generation_id"]),
    )
    section["manifest_mac"] = manifest_mac(mac_key, authenticated_bytes(document))
    reseal(generation, document)


def generation_id(generation: Path) -> str:
    """The generation id in a generation directory's name (``step-<n>.<id>``)."""
    return generation.name.split(".", 1)[1]


def copy_generation(source: Path, store: Path, step: int, generation_id: str) -> Path:
    """A copy of ``source`` under a new directory name (the manifest as it was)."""
    target = store / f"step-{step:012d}.{generation_id}"
    shutil.copytree(source, target)
    target.chmod(0o755)
    for file in target.iterdir():
        writable(file)
    return target


def segments(file: Path) -> tuple[int, int, int]:
    """(offset of segment 0, stored size of a full segment, number of full segments)
    of an encrypted container."""
    data = file.read_bytes()
    (header_len,) = struct.unpack("<I", data[8:12])
    start, record = 12 + header_len, SEGMENT + 28  # 12-byte nonce, 16-byte tag
    return start, record, (len(data) - start) // record


def segment(file: Path, index: int) -> bytes:
    start, record, _ = segments(file)
    return file.read_bytes()[start + index * record : start + (index + 1) * record]


def put_segment(file: Path, index: int, piece: bytes) -> None:
    start, record, _ = segments(file)
    data = bytearray(file.read_bytes())
    data[start + index * record : start + (index + 1) * record] = piece
    replace_bytes(file, bytes(data))


class Touch:
    """Unpickling this runs ``touch MARKER`` (a shell command: code execution)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def pickle_payload(marker: Path) -> bytes:
    return pickle.dumps({"model": Touch(marker)}, protocol=4)


def torch_save_payload(marker: Path) -> bytes:
    """A ``torch.save`` archive whose pickle runs the command on a full ``torch.load``."""
    import io

    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(2), "hook": Touch(marker)}, buffer)  # a test's tool
    return buffer.getvalue()


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels
