"""ckptvault's own errors out of plain ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``.

DCP runs every storage call inside its own error handling and raises a
``CheckpointException`` holding each rank's original exception (on every rank),
so plain DCP code would see ``CheckpointException ranks:dict_keys([0])`` where
ckptvault raised ``IntegrityError``. Constructing a ``cv.dcp.StorageWriter`` or
``StorageReader`` therefore installs, once per process, a thin wrapper around the
two functions DCP's entry points call with the storage object,
``state_dict_saver._save_state_dict`` and ``state_dict_loader._load_state_dict``
(looked up when ``dcp.save``/``dcp.load`` run, so after the plugin object given to
them was constructed; ``dcp.async_save``'s thread calls ``dcp.save``). When the call's
storage object is the plugin's and a rank failed with a ckptvault error (or a storage
``OSError``), the wrapper raises that error, the ``CheckpointException`` as its
cause; a call with any other storage object, or a failure that is DCP's own (its
planner's checks, torch), raises exactly what it raised before.

Nothing in torch changes before a plugin object is constructed, and nothing changes
for other storage writers and readers. On a torch without those two functions the
wrapper is not installed and :func:`typed_errors` does the same job around a call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ckptvault.errors import CheckpointError

__all__ = ["ckptvault_error", "install", "typed_errors"]

_WRAPPED_MARK = "_ckptvault_unwraps"

_lock = threading.Lock()
_installed = False
_plugin_types: tuple[type, ...] = ()  # the storage classes whose errors are unwrapped


def ckptvault_error(exc: CheckpointException) -> CheckpointError | OSError | None:
    """The ckptvault error (or storage ``OSError``) of the lowest rank that raised one
    inside DCP, noted with that rank; None when every failure came from elsewhere
    (DCP's own checks, torch, the user's planner)."""
    for rank, (original, _trace) in sorted(exc.failures.items()):
        if isinstance(original, (CheckpointError, OSError)):
            note = f"(raised on rank {rank} inside torch.distributed.checkpoint)"
            # Python 3.11+; once, though the same error may be unwrapped again.
            if hasattr(original, "add_note") and note not in getattr(original, "__notes__", ()):
                original.add_note(note)
            return original
    return None


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Re-raise what a ckptvault storage object raised inside ``dcp.save``/``load``
    as itself rather than inside DCP's ``CheckpointException``; other failures pass
    through unchanged. Plain ``dcp.save``/``dcp.load`` with the plugin's objects do
    this by default (see the module docstring); this context is kept for code written
    before, and for torch versions where the default cannot be installed::

        with cv.dcp.typed_errors():
            dcp.load(state_dict, storage_reader=cv.dcp.StorageReader(url, run_id="r"))
    """
    try:
        yield
    except CheckpointException as exc:
        error = ckptvault_error(exc)
        if error is None:
            raise
        raise error from exc


def install(plugin_type: type) -> bool:
    """Unwrap the errors of ``plugin_type``'s objects (the plugin's writer or reader)
    in plain DCP calls from now on (idempotent); whether DCP's entry points are
    wrapped."""
    global _installed, _plugin_types
    if _installed and plugin_type in _plugin_types:
        return True
    with _lock:
        if plugin_type not in _plugin_types:
            _plugin_types = (*_plugin_types, plugin_type)
        if not _installed:
            from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

            saving = _wrap(state_dict_saver, "_save_state_dict", "storage_writer")
            loading = _wrap(state_dict_loader, "_load_state_dict", "storage_reader")
            _installed = saving and loading
    return _installed


def _wrap(module: ModuleType, name: str, argument: str) -> bool:
    """Replace ``module.name`` (a function taking the storage object as
    ``argument``) with one that unwraps the plugin's errors; False when torch has no
    such function."""
    original: Callable[..., Any] | None = getattr(module, name, None)
    if original is None or not callable(original):
        return False
    if getattr(original, _WRAPPED_MARK, False):
        return True
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return False
    if argument not in signature.parameters:
        return False

    @functools.wraps(original)
    def unwrapping(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except CheckpointException as exc:
            error = ckptvault_error(exc) if _is_plugin(signature, argument, args, kwargs) else None
            if error is None:
                raise
            raise error from exc

    setattr(unwrapping, _WRAPPED_MARK, True)
    setattr(module, name, unwrapping)
    return True


def _is_plugin(
    signature: inspect.Signature, argument: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    storage = kwargs.get(argument)
    if storage is None and args:
        try:
            storage = signature.bind_partial(*args, **kwargs).arguments.get(argument)
        except TypeError:
            return False
    return isinstance(storage, _plugin_types)
