"""Scheduling saves: synchronous ones inline, asynchronous ones on one background
worker, with bounded staging memory and errors that are never lost.

An asynchronous save copies the state into reusable staging buffers (one slot per
save allowed in flight) and returns; one worker writes and publishes in the order
saves were asked for. When ``max_in_flight`` saves are running the next one waits
for the oldest (``if_busy="wait"``) or is skipped with a warning (``"skip"``). A
background error is raised by its handle's ``result()``, and by the next
``save()``, ``wait()`` or ``close()`` unless it was already raised once.
"""

from __future__ import annotations

import concurrent.futures
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from ckptvault.errors import HostMemoryError
from ckptvault.io.staging import StagingPool
from ckptvault.saving.generation_writer import WrittenGeneration
from ckptvault.saving.handles import SaveHandle, SaveStats
from ckptvault.saving.shared_staging import SharedStagingPool
from ckptvault.saving.staging_budget import check_staging_fits, slot_bytes, staging_budget
from ckptvault.saving.writer_process import WriterProcess
from ckptvault.state.capture import CapturedState
from ckptvault.storage.listing import GenerationInfo

Metrics = dict[str, int | float] | None  # validated, for the manifest
# None: the writer skipped the save (a memory tier without room).
WriteFunction = Callable[[int, CapturedState, Metrics], WrittenGeneration | None]
AnnounceFunction = Callable[[WrittenGeneration], None]
# (step, error, stall seconds, total seconds) of a save that failed after it was accepted
FailureFunction = Callable[[int, BaseException, float, float], None]


class SaveScheduler:
    def __init__(
        self,
        write: WriteFunction,
        announce: AnnounceFunction,
        max_in_flight: int,
        if_busy: str,
        announce_failure: FailureFunction | None = None,
        process: WriterProcess | None = None,
        any_rank: Callable[[bool], bool] | None = None,
    ) -> None:
        """``process``: asynchronous saves go to this writer process, staged in shared
        memory (``async_mode="process"``); synchronous ones are written here.
        ``any_rank`` (a job of several ranks): whether a condition holds on any rank,
        one small collective; the first asynchronous save asks it whether any rank's
        staging does not fit, so that every rank refuses together."""
        self._write = write
        self._process = process
        self._shared = SharedStagingPool(max_in_flight) if process is not None else None
        self._announce = announce
        self._announce_failure = announce_failure
        self.max_in_flight = max_in_flight
        self.if_busy = if_busy
        self.stats = SaveStats()
        self._staging = StagingPool(max_in_flight)
        self._staging_checked = False  # whether the slots were found to fit in memory
        self._any_rank = any_rank
        self._staging_agreed = any_rank is None  # one rank: nothing to agree on
        self._in_flight: list[SaveHandle] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pool_finalizer: weakref.finalize | None = None

    def submit(
        self,
        step: int,
        captured: CapturedState,
        blocking: bool,
        started: float,
        metrics: Metrics = None,
    ) -> SaveHandle:
        """Save now (``blocking``) or stage and save in the background. The first
        asynchronous save raises ``HostMemoryError``, staging nothing, when
        ``max_in_flight`` staging slots would not fit in this host's memory."""
        if not blocking and not self._staging_agreed:
            self._agree_on_staging(captured.tensors)
        elif not blocking and not self._staging_checked:
            self._check_staging(captured.tensors, "the first asynchronous save")
        self.stats.saves_started += 1
        if blocking:
            self.drain()  # generations publish in the order they were asked for
            info = self._run(step, captured, metrics, started)
            seconds = time.perf_counter() - started
            self.stats.last_stall_seconds = self.stats.last_save_seconds = seconds
            if info is None:  # the writer skipped it
                return SaveHandle(step, None, seconds, skipped=True)
            return SaveHandle.completed(info, seconds)
        if not self._make_room(step):
            return SaveHandle(step, None, time.perf_counter() - started, skipped=True)
        copying = time.perf_counter()
        write, staged = self._stage(captured)
        copied = time.perf_counter()
        stall = time.perf_counter() - started
        self.stats.last_stall_seconds = stall
        timing = (stall, copied - copying)
        future = self._executor().submit(self._run, step, staged, metrics, started, timing, write)
        handle = SaveHandle(step, future, stall)
        self._in_flight.append(handle)
        return handle

    def _stage(self, captured: CapturedState) -> tuple[WriteFunction, CapturedState]:
        """Copy the state's tensors into the next staging slot; the function that
        writes the staged copy (here, or in the writer process) and the copy."""
        if self._process is None or self._shared is None:
            tensors = self._staging.next_slot().stage(captured.tensors)
            self.stats.staging_allocations = self._staging.allocations
            return self._write, CapturedState(captured.tree, tensors, captured.rank_tree)
        process, slot = self._process, self._shared.next_slot().stage(captured.tensors)
        self.stats.staging_allocations = self._shared.allocations
        tree_only = CapturedState(captured.tree, {}, captured.rank_tree)
        return (lambda step, c, metrics: process.write(step, slot, c, metrics)), tree_only

    def prepare(self, tensors: dict[str, torch.Tensor], wait: bool = False) -> None:
        """Allocate and fault in the staging buffers for ``tensors`` in the background
        (``wait``: before returning). With a writer process: it starts now too, and
        once the saves in flight are done, its shared-memory slots are made and
        faulted in before this returns. ``HostMemoryError`` (nothing allocated) when
        the slots would not fit in this host's memory."""
        if not self._staging_checked:  # later, this process's own slots hold the memory
            self._check_staging(tensors, "prepare()")
        if self._process is not None and self._shared is not None:
            # Its slots are laid out anew: a save in flight must have been read first.
            self.drain()
            self._process.start()
            self._shared.prepare(tensors)
            self.stats.staging_allocations = self._shared.allocations
            return
        self._staging.prepare(tensors)
        if wait:
            self._staging.finish_preparing()
        self.stats.staging_allocations = self._staging.allocations

    def _agree_on_staging(self, tensors: dict[str, torch.Tensor]) -> None:
        """The first asynchronous save of a job of several ranks: every rank checks its
        own host, then all learn whether any refused, and all refuse together. (A rank
        refusing alone would leave the others waiting in the save's collectives until
        their timeout.) Every rank makes this call at the same save, whether or not its
        ``prepare()`` checked already, so the collective always matches."""
        assert self._any_rank is not None
        refused: HostMemoryError | None = None
        try:
            if not self._staging_checked:
                self._check_staging(tensors, "the first asynchronous save")
        except HostMemoryError as exc:
            refused = exc
        # Any rank, this one included: while one refuses, every rank asks again at
        # its next asynchronous save, so the collective keeps matching.
        if not self._any_rank(refused is not None):
            self._staging_agreed = True
            return
        if refused is not None:
            raise refused
        raise HostMemoryError(
            "the first asynchronous save refused: another rank's host has no memory "
            "for its staging slots (its own error says how much it needs and has); "
            "nothing was staged on any rank. Lower max_in_flight, save synchronously "
            "(async_save=False), or free memory on that node"
        )

    def _check_staging(self, tensors: dict[str, torch.Tensor], when: str) -> None:
        """Refuse staging slots this host has no memory for, before any is allocated."""
        mode = "process" if self._process is not None else "thread"
        budget = staging_budget(slot_bytes(tensors, mode), self.max_in_flight, mode)
        check_staging_fits(budget, when)
        self._staging_checked = True

    def _run(
        self,
        step: int,
        captured: CapturedState,
        metrics: Metrics,
        started: float,
        staged: tuple[float, float] | None = None,
        write: WriteFunction | None = None,
    ) -> GenerationInfo | None:
        """One save, inline or on the worker thread, counted in ``stats`` and told to
        the subscribers; ``staged``: an asynchronous save's (stall, copy) seconds;
        ``write``: what writes it (default: the writer, here). None: the writer
        skipped it."""
        try:
            written = (write or self._write)(step, captured, metrics)
            if written is None:  # the writer skipped it (a memory tier without room)
                self.stats.saves_skipped += 1
                return None
        except BaseException as exc:
            self.stats.saves_failed += 1
            total = time.perf_counter() - started
            if self._announce_failure is not None and isinstance(exc, Exception):
                self._announce_failure(step, exc, staged[0] if staged else total, total)
            raise
        total = time.perf_counter() - started
        stages = dict(written.stages) if staged is None else {"stage": staged[1], **written.stages}
        written = replace(
            written,
            stall_seconds=total if staged is None else staged[0],
            total_seconds=total,
            stages=stages,
            metrics=metrics,
        )
        self.stats.saves_completed += 1
        self.stats.bytes_written += written.info.bytes
        self.stats.plans_reused += int(written.reused_plan)
        self.stats.replica_mismatches += len(written.replica_mismatches)
        self.stats.last_save_seconds = written.seconds
        self._announce(written)  # the save counts as done even if a subscriber fails
        return written.info

    def _make_room(self, step: int) -> bool:
        """Apply backpressure; False when the save is skipped (``if_busy="skip"``)."""
        self._in_flight = [
            h for h in self._in_flight if not h.done() or (h.failed() and not h.reported)
        ]
        busy = [h for h in self._in_flight if not h.done()]
        if len(busy) < self.max_in_flight:
            return True
        if self.if_busy == "skip":
            self.stats.saves_skipped += 1
            warnings.warn(
                f"ckptvault: skipped the save of step {step}: {len(busy)} save(s) still in flight "
                f"(max_in_flight={self.max_in_flight}); save less often or raise max_in_flight",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        while len([h for h in self._in_flight if not h.done()]) >= self.max_in_flight:
            oldest = next(h for h in self._in_flight if not h.done())
            try:
                oldest.result()
            except BaseException:
                oldest.reported = True
                raise
        return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every save in flight (errors stay with their handles), at most
        ``timeout`` seconds; False when some are still running."""
        futures = [h.future for h in self._in_flight if h.future is not None]
        _, running = concurrent.futures.wait(futures, timeout=timeout)
        return not running

    def raise_background_error(self) -> None:
        """Raise the first background error not raised before; forget finished saves."""
        for handle in self._in_flight:
            if handle.failed() and not handle.reported:
                handle.reported = True
                error = handle.exception()
                assert error is not None  # failed() says there is one
                raise error
        self._in_flight = [h for h in self._in_flight if not h.done()]

    def close(self) -> None:
        """Wait for saves in flight, stop the worker, then raise an unreported error."""
        try:
            self._staging.finish_preparing(cancel=True)
            self.drain()
            self.raise_background_error()
        finally:
            if self._pool is not None:
                assert self._pool_finalizer is not None
                self._pool_finalizer.detach()
                self._pool.shutdown(wait=True)
            if self._process is not None and self._shared is not None:
                self._process.close()
                self._shared.close()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # One worker: background saves publish in order, one at a time.
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptvault-save")
            # At interpreter exit, or when dropped unclosed: finish the saves in flight.
            self._pool_finalizer = weakref.finalize(self, self._pool.shutdown, wait=True)
        return self._pool
