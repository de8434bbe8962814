"""Hugging Face weights as a warm start's source: a ``save_pretrained`` directory
(``model.safetensors``, or shards listed by ``model.safetensors.index.json``) or one
``.safetensors`` file.

They are read only and checked before any byte reaches the live model: the index is
bounded JSON whose files are plain names in the directory (no path, no symlink),
listing exactly the tensors those files hold; every file's header is parsed as the
store's own tensor files are (:func:`ckptvault.format.tensorfile.parse_header`: a
bounded header, tensors that tile the data exactly, sizes that match shapes), so a
hostile file is a :class:`~ckptvault.errors.FormatError` and nothing is applied.
Each file's BLAKE3 digest goes into the new run's lineage: a later audit can say
exactly which weights the run started from.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from blake3 import blake3

from ckptvault.errors import FormatError, UsageError
from ckptvault.format.bounded_json import loads_bounded
from ckptvault.format.tensorfile import HEADER_LENGTH_BYTES, header_length, parse_header
from ckptvault.io.dcp_metadata import dtype_from_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20  # an index lists names: a large model's is a few hundred kB


@dataclass(frozen=True)
class SourceFile:
    """One weights file read: its path, size and BLAKE3 digest (hex)."""

    path: Path
    bytes: int
    blake3: str


def is_weights_source(source: object) -> bool:
    """Whether ``source`` names Hugging Face weights rather than a ckptvault store: a
    local ``.safetensors`` file, or a directory holding the index or
    ``model.safetensors``."""
    if not isinstance(source, (str, os.PathLike)) or "://" in os.fspath(source):
        return False
    path = Path(source)
    if path.is_file():
        return path.suffix == ".safetensors"
    return (path / INDEX).is_file() or (path / SINGLE).is_file()


def read_weights(
    source: str | os.PathLike[str],
) -> tuple[dict[str, torch.Tensor], list[SourceFile]]:
    """Every tensor of the weights at ``source`` by name, and the files read."""
    path = Path(source)
    if path.is_file():
        return _read_files([path], None)
    if (path / INDEX).is_file():
        listed = _read_index(path / INDEX)
        files = [_plain_file(path, name) for name in sorted(set(listed.values()))]
        return _read_files(files, listed)
    if (path / SINGLE).is_file():
        return _read_files([path / SINGLE], None)
    raise UsageError(f"{path} holds neither {INDEX} nor {SINGLE}, and is no .safetensors file")


def _read_index(index: Path) -> dict[str, str]:
    """The index's weight_map: tensor name -> file name, checked."""
    size = index.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise FormatError(f"{index}: {size} bytes, more than the {MAX_INDEX_BYTES} an index needs")
    raw = loads_bounded(index.read_bytes(), f"{index}", max_depth=8, max_bytes=MAX_INDEX_BYTES)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{index}: no weight_map of tensor names to file names")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise FormatError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


def _plain_file(directory: Path, name: str) -> Path:
    """``directory / name`` where ``name`` is a plain file name of a regular file."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise FormatError(f"{directory / INDEX}: file {name[:200]!r} is not a plain file name")
    path = directory / name
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise FormatError(f"{directory / INDEX} lists {name!r}, which is not there") from None
    if not stat.S_ISREG(info.st_mode):
        raise FormatError(f"{path}: not a regular file (a symlink or other), refused")
    return path


def _read_files(
    paths: list[Path], listed: dict[str, str] | None
) -> tuple[dict[str, torch.Tensor], list[SourceFile]]:
    tensors: dict[str, torch.Tensor] = {}
    files = []
    for path in paths:
        # A file the index names is opened without following a link (it was checked
        # to be a regular file; it must still be one when opened).
        held, source = _read_file(path, follow=listed is None)
        for name in held:
            if name in tensors:
                raise FormatError(f"{path}: tensor {name!r} is in another file too")
            if listed is not None and listed.get(name) != path.name:
                raise FormatError(f"{path}: holds {name!r}, which the index does not place there")
        tensors.update(held)
        files.append(source)
    if listed is not None and (absent := sorted(set(listed) - set(tensors))):
        raise FormatError(
            f"the index lists {len(absent)} tensor(s) no file holds, such as {absent[0]!r}"
        )
    return tensors, files


def _read_file(path: Path, follow: bool) -> tuple[dict[str, torch.Tensor], SourceFile]:
    """A safetensors file's tensors (views of its bytes, read once) and its digest.
    The header is parsed before the data is read: its tensors must tile exactly the
    bytes the file holds, and a sparse file (sizes it does not hold) is refused."""
    # O_NONBLOCK: a FIFO swapped in after the caller's check must not block the open.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        descriptor = os.open(path, flags)
    except OSError as exc:
        raise FormatError(f"{path}: cannot be opened as a regular file ({exc.strerror})") from exc
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        # Checked on the bare descriptor: os.fdopen of a directory raises and would
        # leave it open, one descriptor leaked per attempt.
        os.close(descriptor)
        raise FormatError(f"{path}: not a regular file")
    os.set_blocking(descriptor, True)
    with os.fdopen(descriptor, "rb") as handle:
        size = info.st_size
        if size > 1 << 20 and info.st_blocks * 512 < size // 2:
            raise FormatError(f"{path}: a sparse file ({size} bytes, most not stored), refused")
        total = header_length(handle.read(HEADER_LENGTH_BYTES), size, str(path))
        header = parse_header(_header_bytes(handle, total), size, str(path))
        data = bytearray(size)
        handle.seek(0)
        if handle.readinto(data) != size or bytes(data[:total]) != header.header_bytes:
            raise FormatError(f"{path}: changed while it was read")
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.entries.items():
        dtype = dtype_from_name(entry.dtype, f"{path}: tensor {name!r}")
        count = entry.nbytes // torch.empty((), dtype=dtype).element_size()
        flat = (
            torch.frombuffer(data, dtype=dtype, count=count, offset=entry.start)
            if count
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.reshape(entry.shape)
    return tensors, SourceFile(path, size, blake3(data).hexdigest())


def _header_bytes(handle: Any, total: int) -> bytes:
    """The file's first ``total`` bytes (the length prefix and the JSON header)."""
    handle.seek(0)
    return bytes(handle.read(total))
