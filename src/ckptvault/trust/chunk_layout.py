"""Chunk layout: the manifest's DCP chunks against the shapes and the tensor files.

Every tensor's chunks must tile its shape exactly (no gap, no overlap: bytes that
were never written must never reach a restored tensor), and every chunk must sit
in a listed file, at the offset, size, dtype and shape the file's header says.
"""

from __future__ import annotations

from typing import Any

from ckptvault.format.manifest import Manifest
from ckptvault.format.tensorfile import TensorFileHeader
from ckptvault.trust.problems import MANIFEST_INCONSISTENT, MANIFEST_INVALID, Problem


def check_chunk_locations(
    manifest: Manifest, headers: dict[str, TensorFileHeader]
) -> list[Problem]:
    """Tie the manifest's DCP chunks to the tensor file headers (for the files in
    ``headers``; encrypted files are checked once decrypted)."""
    problems = []
    try:
        for fqn, info in manifest.dcp["tensors"].items():
            tiling = _tiling_problem(info)
            if tiling is not None:
                problems.append(Problem(MANIFEST_INCONSISTENT, f"tensor {fqn!r}: {tiling}"))
                continue
            for chunk in info["chunks"]:
                file, name = chunk["file"], chunk["name"]
                if file not in manifest.files:
                    problems.append(
                        Problem(
                            MANIFEST_INCONSISTENT, f"tensor {fqn!r} lives in unlisted file {file}"
                        )
                    )
                    continue
                header = headers.get(file)
                if header is None:
                    continue
                found = header.entries.get(name)
                if (
                    found is None
                    or found.start != chunk["start"]
                    or found.nbytes != chunk["length"]
                    or found.dtype != info["dtype"]
                    or list(found.shape) != list(chunk["sizes"])
                ):
                    problems.append(
                        Problem(
                            MANIFEST_INCONSISTENT,
                            f"tensor {fqn!r} chunk {chunk['offsets']} is not where the manifest says ({file}:{name})",
                            file,
                        )
                    )
    except (KeyError, TypeError, AttributeError) as exc:
        problems.append(Problem(MANIFEST_INVALID, f"dcp metadata is malformed ({exc!r})"))
    return problems


def _volume(sizes: list[int]) -> int:
    volume = 1
    for size in sizes:
        volume *= size
    return volume


def _tiling_problem(info: dict[str, Any]) -> str | None:
    """Why a tensor's chunks do not cover its shape exactly once, or None."""
    shape = [int(d) for d in info["shape"]]
    chunks = info["chunks"]
    boxes = []
    for chunk in chunks:
        offsets, sizes = [int(o) for o in chunk["offsets"]], [int(s) for s in chunk["sizes"]]
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"chunk {offsets} has the wrong rank"
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            return f"chunk {offsets}+{sizes} lies outside the shape {shape}"
        boxes.append((offsets, sizes))
    if sum(_volume(s) for _, s in boxes) != _volume(shape) or (_volume(shape) and not boxes):
        return f"its chunks do not cover the shape {shape} exactly"
    if len(boxes) <= 256:
        for i, (o1, s1) in enumerate(boxes):
            for o2, s2 in boxes[i + 1 :]:
                if (
                    all(a < c + t and c < a + s for a, s, c, t in zip(o1, s1, o2, s2, strict=True))
                    and _volume(s1)
                    and _volume(s2)
                ):
                    return f"chunks {o1} and {o2} overlap"
    return None
