"""The small JSON files that stand at Lightning's checkpoint paths.

Lightning's ``ModelCheckpoint`` thinks in files: it names ``epoch=0-step=10.ckpt``,
checks that a path exists, finds ``last*.ckpt`` by listing the directory, compares
modification times for ``ckpt_path="last"``, and links ``last.ckpt`` to the newest
file with ``save_last="link"``. So the plugin writes, at each path Lightning names, a
*pointer*: a few hundred bytes of canonical JSON naming the generation that holds the
checkpoint (``{"ckptvault_lightning": 1, "generation_id": ..., "run_id": ...,
"step": ..., "store": ...}``). The checkpoint itself lives in the ckptvault store,
signed and verified like any other generation; a pointer is never trusted for more
than *which* generation to look for (restore verifies it whatever the pointer says).

A pointer is read like anything an attacker could have written: bounded in size and
depth, every field checked. A file that is not a pointer (a pickled ``.ckpt`` of
``TorchCheckpointIO``, say) is a :class:`~ckptvault.errors.FormatError`: this plugin
never unpickles.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ckptvault.config import validate_step
from ckptvault.durable import make_dirs_durable, write_atomically
from ckptvault.errors import FormatError, UsageError
from ckptvault.format.bounded_json import loads_bounded
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import GenerationName, is_generation_id

logger = logging.getLogger("ckptvault")

FORMAT_KEY = "ckptvault_lightning"
FORMAT_VERSION = 1
_FIELDS = frozenset({FORMAT_KEY, "generation_id", "run_id", "step", "store"})
MAX_POINTER_BYTES = 8192  # a pointer is ~200 bytes; a store URL may be long
_MAX_TEXT = 4096
SUFFIX = ".ckpt"  # what ModelCheckpoint names its files


@dataclass(frozen=True)
class Pointer:
    """Which generation a Lightning checkpoint path stands for."""

    run_id: str
    step: int
    generation_id: str
    store: str  # where it was written (informational: the plugin reads its own store)

    @property
    def name(self) -> GenerationName:
        return GenerationName(self.step, self.generation_id)

    def to_bytes(self) -> bytes:
        return dumps_canonical(
            {
                FORMAT_KEY: FORMAT_VERSION,
                "generation_id": self.generation_id,
                "run_id": self.run_id,
                "step": self.step,
                "store": self.store,
            }
        )


def write_pointer(path: Path, pointer: Pointer) -> None:
    """Put ``pointer`` at ``path``, durably and atomically (a crash leaves the old
    pointer or the new one); creates the directory as Lightning's own writer does."""
    make_dirs_durable(path.parent)
    write_atomically(path, pointer.to_bytes())


def read_pointer(path: Path) -> Pointer:
    """The pointer at ``path`` (a symlink to one is followed: ``save_last="link"``).

    Raises ``FileNotFoundError`` when nothing is there (as Lightning's own loader
    does) and :class:`FormatError` for anything that is not a pointer."""
    # Non-blocking, and only a regular file is read: a FIFO planted here must not hang
    # the trainer.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{path} is not a regular file, so not a checkpoint pointer")
        data = _read_bounded(fd, MAX_POINTER_BYTES)
    finally:
        os.close(fd)
    if len(data) > MAX_POINTER_BYTES or not data.startswith(b"{"):
        raise FormatError(
            f"{path} is not a ckptvault checkpoint pointer (a pickled .ckpt from another "
            "CheckpointIO, perhaps): CkptvaultCheckpointIO never unpickles. Load it with the "
            "plugin that wrote it, or resume from a checkpoint this plugin saved"
        )
    return parse_pointer(data, str(path))


def parse_pointer(data: bytes, where: str) -> Pointer:
    """Check every field of a pointer's bytes; :class:`FormatError` names what is wrong."""
    value = loads_bounded(data, f"checkpoint pointer {where}", max_depth=2)
    if not isinstance(value, dict) or set(value) != _FIELDS:
        raise FormatError(
            f"{where} is not a ckptvault checkpoint pointer: it must hold exactly "
            f"{', '.join(sorted(_FIELDS))}"
        )
    if value[FORMAT_KEY] != FORMAT_VERSION or type(value[FORMAT_KEY]) is not int:
        raise FormatError(
            f"{where}: pointer format {str(value[FORMAT_KEY])[:20]!r} is not one this "
            f"ckptvault reads ({FORMAT_VERSION}); upgrade ckptvault"
        )
    run_id, generation_id, store = value["run_id"], value["generation_id"], value["store"]
    if not all(type(text) is str and 0 < len(text) <= _MAX_TEXT for text in (run_id, store)):
        raise FormatError(f"{where}: the pointer's run_id and store must be short strings")
    if type(generation_id) is not str or not is_generation_id(generation_id):
        raise FormatError(f"{where}: {str(generation_id)[:64]!r} is not a generation id")
    try:
        step = validate_step(value["step"])
    except UsageError:
        raise FormatError(f"{where}: the pointer's step is not a step number") from None
    return Pointer(run_id=run_id, step=step, generation_id=generation_id, store=store)


def try_read_pointer(path: Path) -> Pointer | None:
    """The pointer at ``path``, or None when nothing readable is there (a dangling
    link, another plugin's file, a damaged pointer: each logged at debug level)."""
    try:
        return read_pointer(path)
    except (OSError, FormatError) as exc:
        logger.debug("not a checkpoint pointer: %s (%s)", path, exc)
        return None


def _read_bounded(fd: int, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``fd`` (one more than allowed shows it is too big)."""
    data = b""
    while len(data) <= limit:
        chunk = os.read(fd, limit + 1 - len(data))
        if not chunk:
            break
        data += chunk
    return data
