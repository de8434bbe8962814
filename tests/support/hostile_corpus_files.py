"""Corpus entries (see :mod:`hostile_corpus`): pickle payloads, names that point
outside the generation, links and special files in it. Those aimed at an index are
in :mod:`hostile_corpus_indexes`."""

from __future__ import annotations

import os
import stat

from support.hostile_corpus import PATHS, PICKLE, hostile
from support.hostile_plants import (
    Plot,
    forge_manifest,
    forge_root,
    pickle_payload,
    replace_bytes,
    resign,
    torch_save_payload,
)

# -- pickle payloads: would run code if anything unpickled them ------------------------


@hostile(PICKLE, "plain", "tensor-file-invalid", formats=(3, 2))
def pickle_as_tensor_file(plot: Plot) -> int:
    replace_bytes(plot.tensor_file(2), pickle_payload(plot.marker))
    forge_manifest(plot.gen(2))
    return 2


@hostile(PICKLE, "plain", "tensor-file-invalid", formats=(3, 2))
def torch_save_archive_as_tensor_file(plot: Plot) -> int:
    replace_bytes(plot.tensor_file(2), torch_save_payload(plot.marker))
    forge_manifest(plot.gen(2))
    return 2


@hostile(PICKLE, "plain", "pickle-file", formats=(3, 2))
def pickle_file_listed_in_the_manifest(plot: Plot) -> int:
    """Listed with its real digests (in format 3 under rank 0's prefix, its chunk
    digests in rank 0's index)."""
    gen = plot.gen(2)
    name = "r00000-optimizer.pt" if plot.format == 3 else "optimizer.pt"
    (gen / name).write_bytes(pickle_payload(plot.marker))
    empty = {"size": 0, "blake3": "0" * 64, "chunks": []}
    forge_manifest(gen, lambda m: m["files"].update({name: empty}))
    forge_manifest(gen)  # its record now holds the pickle's real size and digests
    return 2


@hostile(PICKLE, "signed", "pickle-file")
def pickle_file_beside_a_signed_manifest(plot: Plot) -> int:
    (plot.gen(2) / "model.pth").write_bytes(torch_save_payload(plot.marker))
    return 2


@hostile(PICKLE, "plain", "manifest-invalid", formats=(3, 2))
def pickle_as_manifest(plot: Plot) -> int:
    replace_bytes(plot.gen(2) / "manifest.json", pickle_payload(plot.marker))
    return 2


@hostile(PICKLE, "signed", "signature-invalid")
def pickle_as_signature(plot: Plot) -> int:
    replace_bytes(plot.gen(2) / "manifest.sig", pickle_payload(plot.marker))
    return 2


@hostile(PICKLE, "encrypted", "tensor-file-invalid", formats=(3, 2))
def pickle_as_state_file(plot: Plot) -> int:
    replace_bytes(plot.state_file(2), pickle_payload(plot.marker))
    forge_manifest(plot.gen(2))
    return 2


# -- paths: names that point outside the generation -------------------------------------


def _rename_file_record(plot: Plot, name: str) -> None:
    """The tensor file listed as ``name``. Format 2: in ``files`` and in every chunk
    of ``dcp``; format 3: in the root's ``files`` (no index could cover the name)."""
    old = plot.tensor_file(2).name
    if plot.format == 3:
        forge_root(plot.gen(2), lambda root: root["files"].update({name: root["files"].pop(old)}))
        return

    def rename(manifest: dict) -> None:
        manifest["files"][name] = manifest["files"].pop(old)
        for info in manifest["dcp"]["tensors"].values():
            for chunk in info["chunks"]:
                chunk["file"] = name

    forge_manifest(plot.gen(2), rename)


@hostile(PATHS, "plain", "unsafe-path", formats=(3, 2))
def traversal_in_the_file_list(plot: Plot) -> int:
    _rename_file_record(plot, "../../outside/secret.bin")
    return 2


@hostile(PATHS, "plain", "unsafe-path", formats=(3, 2))
def nested_traversal_in_the_file_list(plot: Plot) -> int:
    _rename_file_record(plot, "a/../../../outside/secret.bin")
    return 2


@hostile(PATHS, "plain", "unsafe-path")
def traversal_behind_a_rank_prefix_in_the_file_list(plot: Plot) -> int:
    _rename_file_record(plot, "r00000-/../../outside/secret.bin")
    return 2


@hostile(PATHS, "plain", "unsafe-path", formats=(3, 2))
def absolute_path_in_the_file_list(plot: Plot) -> int:
    _rename_file_record(plot, str(plot.secret))
    return 2


@hostile(PATHS, "signed", "unsafe-path", formats=(3, 2))
def traversal_in_a_validly_signed_manifest(plot: Plot) -> int:
    _rename_file_record(plot, "../../outside/secret.bin")
    resign(plot.gen(2), plot.key("trainer.pem"))  # an insider: still no way out
    return 2


def _point_chunks_at(plot: Plot, target: str, field: str) -> None:
    def point(manifest: dict) -> None:
        for info in manifest["dcp"]["tensors"].values():
            info["chunks"][0][field] = target

    forge_manifest(plot.gen(2), point)


# A chunk's file in format 2's dcp section (format 3's index: hostile_corpus_indexes).
@hostile(PATHS, "plain", "manifest-inconsistent", formats=(2,))
def traversal_in_a_tensor_chunk_file(plot: Plot) -> int:
    _point_chunks_at(plot, "../../outside/secret.bin", "file")
    return 2


@hostile(PATHS, "plain", "manifest-inconsistent", formats=(2,))
def absolute_path_in_a_tensor_chunk_file(plot: Plot) -> int:
    _point_chunks_at(plot, str(plot.secret), "file")
    return 2


@hostile(PATHS, "plain", "manifest-inconsistent", formats=(3, 2))
def traversal_in_a_tensor_entry_name(plot: Plot) -> int:
    _point_chunks_at(plot, "../../outside/secret.bin", "name")
    return 2


# -- links and special files in the generation ------------------------------------------


def _swap_for_symlink(entry: str, plot: Plot, target: os.PathLike[str] | str) -> None:
    path = plot.gen(2) / entry
    path.unlink()
    path.symlink_to(target)


def _outside_copy(plot: Plot, path: os.PathLike[str]) -> os.PathLike[str]:
    copy = plot.outside / os.path.basename(path)
    copy.write_bytes(open(path, "rb").read())  # noqa: SIM115 (a one-off read)
    return copy


@hostile(PATHS, "plain", "unsafe-entry")
def tensor_file_symlinked_to_a_secret(plot: Plot) -> int:
    _swap_for_symlink(plot.tensor_file(2).name, plot, plot.secret)
    return 2


@hostile(PATHS, "plain", "unsafe-entry", formats=(3, 2))
def tensor_file_symlinked_to_identical_bytes(plot: Plot) -> int:
    copy = _outside_copy(plot, plot.tensor_file(2))  # every digest matches
    _swap_for_symlink(plot.tensor_file(2).name, plot, copy)
    return 2


@hostile(PATHS, "signed", "unsafe-entry", formats=(3, 2))
def manifest_symlinked_to_identical_bytes(plot: Plot) -> int:
    copy = _outside_copy(plot, plot.gen(2) / "manifest.json")  # the signature matches
    _swap_for_symlink("manifest.json", plot, copy)
    return 2


@hostile(PATHS, "signed", "unsafe-entry")
def signature_symlinked_to_identical_bytes(plot: Plot) -> int:
    copy = _outside_copy(plot, plot.gen(2) / "manifest.sig")
    _swap_for_symlink("manifest.sig", plot, copy)
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def extra_symlink_to_a_secret(plot: Plot) -> int:
    (plot.gen(2) / "notes.txt").symlink_to(plot.secret)
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def generation_directory_symlinked_to_a_copy(plot: Plot) -> int:
    gen = plot.gen(2)
    copy = plot.outside / gen.name
    gen.rename(copy)  # the same bytes, now outside the store
    gen.symlink_to(copy, target_is_directory=True)
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def tensor_file_hard_linked_outside(plot: Plot) -> int:
    os.link(plot.tensor_file(2), plot.outside / "second-name.safetensors")  # identical bytes
    return 2


@hostile(PATHS, "signed", "unsafe-entry")
def manifest_hard_linked_outside(plot: Plot) -> int:
    os.link(plot.gen(2) / "manifest.json", plot.outside / "manifest.json")
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def tensor_file_replaced_by_a_fifo(plot: Plot) -> int:
    file = plot.tensor_file(2)
    file.unlink()
    os.mkfifo(file)  # a reader that opened it would block forever
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def extra_fifo(plot: Plot) -> int:
    os.mkfifo(plot.gen(2) / "pipe")
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def tensor_file_replaced_by_a_device(plot: Plot) -> int:
    """``/dev/zero``'s device numbers: endless bytes to whoever reads it. Without the
    privilege to make a device node, a socket stands in (another special file)."""
    file = plot.tensor_file(2)
    file.unlink()
    try:
        os.mknod(file, 0o444 | stat.S_IFCHR, os.makedev(1, 5))
    except PermissionError:
        _bind_socket(file)
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def extra_unix_socket(plot: Plot) -> int:
    _bind_socket(plot.gen(2) / "control.sock")
    return 2


def _bind_socket(path: os.PathLike[str]) -> None:
    os.mknod(path, 0o644 | stat.S_IFSOCK)  # a socket inode, as bind() leaves behind


@hostile(PATHS, "plain", "unsafe-entry")
def subdirectory_in_the_generation(plot: Plot) -> int:
    nested = plot.gen(2) / "nested"
    nested.mkdir()
    (nested / plot.tensor_file(2).name).write_bytes(plot.tensor_file(2).read_bytes())
    return 2
