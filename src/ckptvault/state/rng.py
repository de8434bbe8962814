"""``RNGState``: the process-global random number generators, as one state entry.

A training run draws from several independent sources: Python's ``random``, NumPy's
legacy global RNG (``np.random.*``), torch's CPU generator and one generator per
CUDA device. ``RNGState()`` captures all of them when saved and sets all of them
when restored — always after every other entry, so that restoring models or
optimizers cannot consume randomness after the RNG is set. Independent generators
(``np.random.Generator``, ``torch.Generator``) are separate state entries.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ckptvault.errors import StateMismatchError


class RNGState:
    """Marker for the global RNGs; put an instance in the state dict."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=False),
            "torch_cpu": torch.get_rng_state(),
            "cuda": _cuda_states(),
        }

    def check_state_dict(self, state: dict[str, Any], where: str) -> None:
        """Raise :class:`StateMismatchError` if ``state`` cannot be applied here."""
        saved_devices = len(state.get("cuda", []))
        if saved_devices and saved_devices != _cuda_device_count():
            raise StateMismatchError(
                f"{where}: the checkpoint holds RNG states for {saved_devices} CUDA devices but "
                f"this process sees {_cuda_device_count()}; restore on the same topology, or "
                "drop RNGState from the state dict to continue without bit-exact randomness",
                mismatched=[f"{where}['cuda']"],
            )
        python_state = state.get("python")
        if not (isinstance(python_state, tuple) and len(python_state) == 3):
            raise StateMismatchError(
                f"{where}: the saved Python RNG state is malformed; the generation was not "
                "written by RNGState. Restore without the RNGState entry (strict=False)."
            )
        # Each state is tried on a scratch generator first, so that applying it later
        # cannot fail halfway through the global RNGs.
        for source, trial in (
            ("python", lambda: random.Random().setstate(state["python"])),
            ("numpy", lambda: np.random.RandomState().set_state(state["numpy"])),
            ("torch_cpu", lambda: torch.Generator().set_state(state["torch_cpu"])),
        ):
            try:
                trial()
            except Exception as exc:  # whatever the generator's own checks raise
                raise StateMismatchError(
                    f"{where}: the saved {source} RNG state is malformed ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); the generation was not written by RNGState",
                    mismatched=[f"{where}[{source!r}]"],
                ) from exc
        for index, cuda_state in enumerate(state.get("cuda", [])):
            expected = torch.cuda.get_rng_state(index)
            if not (
                isinstance(cuda_state, torch.Tensor)
                and cuda_state.dtype == expected.dtype
                and cuda_state.shape == expected.shape
            ):
                raise StateMismatchError(
                    f"{where}: the saved RNG state of CUDA device {index} is malformed",
                    mismatched=[f"{where}['cuda'][{index}]"],
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state, "RNGState")
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch_cpu"])
        for index, cuda_state in enumerate(state.get("cuda", [])):
            torch.cuda.set_rng_state(cuda_state, index)

    def __repr__(self) -> str:
        return "RNGState()"


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_states() -> list[torch.Tensor]:
    # Reading a CUDA generator's state does not draw from it.
    return [torch.cuda.get_rng_state(index) for index in range(_cuda_device_count())]
