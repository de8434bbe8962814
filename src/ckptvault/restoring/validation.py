"""Validation: a checkpoint that has never been loaded is not a checkpoint yet.

Verification proves the bytes are the ones written; it does not prove that they
load into the model the job will run next, or that the loaded model computes
anything sensible. :class:`Validator` restores a generation into objects freshly
built by the user's *factory* and runs the user's *check* on them (a forward pass
with a finite loss, say), then tells the event bus (:class:`~ckptvault.events.Validated`):
the catalog stamps the generation ``validated``, retention never prunes the newest
validated generation, and ``ckptvault status`` reports its age.

The factory is called with no arguments and returns either the state mapping to
restore into, or ``(state, check)`` where ``check(state)`` raises or returns
``False`` when the loaded state is not good. ``module:function`` (or
``path/to/file.py:function``) names one on the command line.

A validation is a reader: it never moves the rollback floor, writes the audit log
or counts as the job's restore, and it may load a generation below the floor.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ckptvault.coordinator import SingleProcess
from ckptvault.errors import NoValidCheckpoint, UsageError, ValidationError
from ckptvault.events import Event, EventBus, Published, Validated
from ckptvault.restoring.restorer import Restorer
from ckptvault.run_context import RunContext
from ckptvault.state.names import ApplyOptions

logger = logging.getLogger("ckptvault")

Check = Callable[[Mapping[str, Any]], object]
Factory = Callable[[], Any]  # a state mapping, or (state, check)


@dataclass(frozen=True)
class ValidationResult:
    step: int
    generation_id: str | None
    ok: bool
    seconds: float
    error: str | None = None  # "ErrorType: first line" when not ok

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_factory(spec: str) -> Factory:
    """The function ``spec`` names: ``package.module:function`` (importable, the
    working directory first, as ``python -m`` imports) or ``path/to/file.py:function``."""
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function.isidentifier():
        raise UsageError(f"--factory {spec!r}: give module:function or path/to/file.py:function")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            loader = importlib.util.spec_from_file_location(f"_ckptvault_factory_{path.stem}", path)
            if loader is None or loader.loader is None or not path.is_file():
                raise UsageError(f"--factory {spec!r}: no Python file at {path}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[loader.name] = module
            loader.loader.exec_module(module)
        else:
            # From the working directory too, as ``python -m`` finds modules: the
            # ``ckptvault`` script's own directory is the one on sys.path otherwise.
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--factory {spec!r}: cannot import {module_name}: {exc}") from exc
    factory = getattr(module, function, None)
    if not callable(factory):
        raise UsageError(f"--factory {spec!r}: {module_name} has no function {function}")
    return factory


def _built(factory: Factory) -> tuple[MutableMapping[str, Any], Check | None]:
    built = factory()
    if isinstance(built, tuple) and len(built) == 2 and callable(built[1]):
        state, check = built
    else:
        state, check = built, None
    if not isinstance(state, MutableMapping):
        raise UsageError(
            f"the validation factory returned a {type(state).__name__}; return the state "
            "dict to restore into, or (state, check)"
        )
    return state, check


class Validator:
    """Loads generations of ``run``'s store into fresh objects and checks them."""

    def __init__(self, run: RunContext, threads: int) -> None:
        # Verification only: the same keys and signatures, but no floor, no audit
        # entry, no events from the restore itself (it is not the job's restore).
        reader_trust = replace(run.trust, ledger=None, audit=None, signer=None)
        quiet = RunContext(run.store, run.run_id, reader_trust, SingleProcess(), EventBus([]))
        self.restorer = Restorer(quiet, threads, contract_fields=None)
        self.run = run

    def validate(self, step: int | None, factory: Factory) -> ValidationResult:
        """Validate the newest generation (of ``step``, when given); never raises for
        a generation that fails (the result says why), only for usage errors."""
        started = time.perf_counter()
        state, check = _built(factory)
        generation_id, target = None, step if step is not None else -1
        try:
            # Strict over what the factory built, which may be a subset (the model
            # alone): the checkpoint's other entries are left out, not unexpected.
            subset = ApplyOptions(live_entries_only=True)
            info = self.restorer.restore(state, step, strict=True, options=subset)
            if info is None:
                raise NoValidCheckpoint(f"no generation in {self.run.store.location}")
            generation_id, target = info.generation_id, info.step
            if check is not None and check(state) is False:
                raise ValidationError(
                    f"generation {generation_id} (step {target}) loaded, but the check "
                    "returned False"
                )
            error = None
        except UsageError:
            raise
        except Exception as exc:  # the user's check may raise anything: that is the answer
            first = str(exc).splitlines()[0][:500] if str(exc) else ""
            error = (type(exc).__name__, first)
        seconds = time.perf_counter() - started
        self.run.events.emit(
            Validated(
                run_id=self.run.run_id,
                store=self.run.store.location,
                step=target,
                generation_id=generation_id,
                ok=error is None,
                seconds=seconds,
                error=error[0] if error else None,
                reason=error[1] if error else None,
            )
        )
        message = f"{error[0]}: {error[1]}" if error else None
        return ValidationResult(target, generation_id, error is None, seconds, message)


class SampledValidation:
    """Validates one published generation in ``every`` on a background thread
    (``CheckpointManager(validate_every=K, validate_with=factory)``), one at a time;
    failures are logged and recorded, never raised into training."""

    def __init__(self, validator: Validator, every: int, factory: Factory | str) -> None:
        if type(every) is not int or every < 1:
            raise UsageError(f"validate_every must be an int >= 1, got {every!r}")
        self.validator = validator
        self.every = every
        self.factory = load_factory(factory) if isinstance(factory, str) else factory
        self._published = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptvault-validate")
        self._pending: list[Future[ValidationResult]] = []

    def __call__(self, event: Event) -> None:
        if not isinstance(event, Published):
            return
        self._published += 1
        if self._published % self.every == 0:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._pool.submit(self._run, event.step))

    def _run(self, step: int) -> ValidationResult:
        result = self.validator.validate(step, self.factory)
        if not result.ok:
            logger.error("validation of step %d failed: %s", step, result.error)
        return result

    def close(self) -> None:
        """Wait for the validation in progress, then stop the thread."""
        self._pool.shutdown(wait=True)
