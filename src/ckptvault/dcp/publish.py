"""The coordinator's end of a DCP plugin save: one manifest over every rank's files,
signed, published atomically.

Mirrors what :class:`~ckptvault.saving.generation_writer.GenerationWriter` does for
the manager, for a save whose state is DCP's alone: DCP's metadata, as JSON,
describes every tensor, and the manifest's ``state`` holds the state dict's
non-tensor values (``{}`` when there are none; :mod:`ckptvault.dcp.objects`), or, in
an encrypted run, a reference to an encrypted state file holding that tree (an
encrypted run never writes plaintext, and readers check exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptvault._version import __version__
from ckptvault.format.layout import encrypted_state_file_name, generation_created_at
from ckptvault.format.manifest import Manifest
from ckptvault.io.state_file import ENCRYPTED_STATE_TAG, write_state_file
from ckptvault.io.writer import VaultStorageWriter
from ckptvault.saving.generation_writer import encryption_section
from ckptvault.saving.indexes import IndexWriter
from ckptvault.storage.base import StagingArea
from ckptvault.storage.listing import GenerationInfo
from ckptvault.trust.context import TrustContext
from ckptvault.trust.envelope import FileEncryption
from ckptvault.trust.manifest_auth import seal_manifest

# What the manifest's ``writer`` says, so that tools can tell plugin saves apart.
PLUGIN_NAME = "ckptvault.dcp"


@dataclass(frozen=True)
class PublishedGeneration:
    """What a publish made: the generation as listed, and the KEK its keys are
    wrapped under (None when not encrypted), for the records."""

    info: GenerationInfo
    kek_id: str | None


@dataclass(frozen=True)
class SaveSettings:
    run_id: str
    step: int
    chunk_size: int
    segment_size: int
    threads: int


def publish_generation(
    area: StagingArea,
    written: VaultStorageWriter,
    settings: SaveSettings,
    trust: TrustContext,
    world_size: int,
    tree: dict[str, Any],
) -> PublishedGeneration:
    """Adopt the other ranks' files, write the manifest (and its signature) and
    publish; ``written`` has finished (it holds every rank's file records and the
    DCP metadata), ``tree`` is the state tree of the non-tensor values. The caller
    aborts ``area`` if this raises: nothing is visible then."""
    generation_id = area.generation_id
    others = sorted(set(written.file_records) - set(written.own_files))
    area.adopt(others)
    encryption = None
    if trust.keystore is not None:
        encryption = FileEncryption(
            trust.keystore, settings.run_id, generation_id, settings.segment_size
        )
    state = _state(area, written, settings, encryption, tree)
    manifest = _manifest(area, written, settings, generation_id, state, world_size, encryption)
    manifest_bytes = manifest.to_bytes()
    ref = area.publish(settings.step, manifest_bytes, trust.sign_manifest(manifest_bytes))
    info = GenerationInfo(
        settings.step, generation_id, ref.location, manifest.stored_bytes, manifest.created_at
    )
    return PublishedGeneration(info, manifest.encryption.kek_id if manifest.encryption else None)


def _state(
    area: StagingArea,
    written: VaultStorageWriter,
    settings: SaveSettings,
    encryption: FileEncryption | None,
    tree: dict[str, Any],
) -> dict[str, Any]:
    """``tree``; encrypted: the reference to an encrypted state file holding it."""
    if encryption is None:
        return tree
    name = encrypted_state_file_name(0)
    record, wrapped = write_state_file(area, name, tree, settings.chunk_size, encryption)
    written.file_records[name] = record
    written.wrapped_keys[name] = wrapped
    return {ENCRYPTED_STATE_TAG: name}


def _manifest(
    area: StagingArea,
    written: VaultStorageWriter,
    settings: SaveSettings,
    generation_id: str,
    state: dict[str, Any],
    world_size: int,
    encryption: FileEncryption | None,
) -> Manifest:
    section, mac_key = None, None
    if encryption is not None:
        mac_key, kek_id, wrapped_mac_key = encryption.new_manifest_key()
        section = encryption_section(
            written.wrapped_keys, settings.segment_size, (kek_id, wrapped_mac_key)
        )
    manifest = Manifest(
        run_id=settings.run_id,
        step=settings.step,
        generation_id=generation_id,
        created_at=generation_created_at(generation_id),
        parent=None,
        chunk_size=settings.chunk_size,
        files=dict(written.file_records),
        dcp=written.dcp_json or {"version": None, "tensors": {}},
        state=state,
        contract={},
        writer={"ckptvault": __version__, "world_size": world_size, "via": PLUGIN_NAME},
        encryption=section,
    )
    manifest = IndexWriter().write(area, manifest)  # before the root that covers them
    return manifest if mac_key is None else seal_manifest(manifest, mac_key)
