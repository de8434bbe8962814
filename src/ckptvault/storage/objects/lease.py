"""The writer lease of an object store: one writer at a time, without a lock server.

An object store (S3, Azure Blob) has no ``flock``; conditional writes are enough for
a lease. The lease is the object ``.writer.lock`` holding its holder (pid, host, a
random token), its duration and whether it was released:

- **take**: create it with ``If-None-Match: *``; when it exists, read it and take it
  over with ``If-Match: <the ETag read>`` only when it was released, has expired,
  or its holder is provably dead. Two takers of one lease cannot both win: the
  second ``If-Match`` fails.
- **keep**: a daemon thread renews it every third of its duration with
  ``If-Match: <our ETag>``; a renewal that fails its condition means someone took
  the lease over, and the holder knows it lost it.
- **publish**: the publish rule renews once more (:meth:`ObjectWriterLease.confirm`)
  right before the manifest PUT and refuses to publish when that fails.
- **release**: overwrite it with a released record (``If-Match``), never a blind delete.

Each backend reaches its lease object through a :class:`LeaseObject` (create,
replace if unchanged, read). Expiry is judged on the server's clock (the response's
``Date`` minus the lease's ``Last-Modified``), never by comparing two machines' clocks. A holder on this very
machine (same host, boot and pid namespace) whose process is gone — or is another
process reusing its pid — is provably dead, so a killed local writer does not
block its restart for a lease duration. A writer that crashed elsewhere blocks new
writers until its lease expires. A holder that stalls longer than the lease (a
paused VM) may lose it mid-save; it then refuses to publish. (A stall between the
last renewal and the manifest PUT itself cannot be detected by any lease.)
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from ckptvault.errors import FormatError, SaveFailedError, StoreLockedError
from ckptvault.format.bounded_json import loads_bounded
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import utc_now
from ckptvault.storage.objects.errors import (
    ObjectNotFound,
    ObjectPreconditionFailed,
    ObjectStoreError,
)

logger = logging.getLogger("ckptvault")

MAX_LEASE_BYTES = 4096
_TAKE_ATTEMPTS = 5


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _process_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks)`` of a process, None when there is none."""
    raw = _read_text(f"/proc/{pid}/stat")
    fields = raw.rpartition(")")[2].split()  # the command name may hold spaces
    if len(fields) < 20:
        return None
    return fields[0], int(fields[19])


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: enough to name it, and to prove it dead on this machine."""

    pid: int
    host: str
    boot_id: str
    pid_ns: str
    start_ticks: int
    token: str
    since: str

    @classmethod
    def current(cls, token: str) -> Holder:
        try:
            pid_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_ns = ""
        stat = _process_stat(os.getpid())
        return cls(
            pid=os.getpid(),
            host=socket.gethostname(),
            boot_id=_read_text("/proc/sys/kernel/random/boot_id"),
            pid_ns=pid_ns,
            start_ticks=stat[1] if stat else -1,
            token=token,
            since=utc_now(),
        )

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.since}"[:300]

    def provably_dead(self) -> bool:
        """Same machine and pid namespace, and its process is gone (or a zombie, or
        another process now has its pid). Anywhere else nothing is provable."""
        me = Holder.current("")
        same_machine = (self.host, self.boot_id, self.pid_ns) == (me.host, me.boot_id, me.pid_ns)
        if not same_machine or not self.boot_id or not self.pid_ns or self.start_ticks < 0:
            return False
        stat = _process_stat(self.pid)
        return stat is None or stat[0] in ("Z", "X") or stat[1] != self.start_ticks


@dataclass(frozen=True)
class LeaseRecord:
    holder: Holder
    seconds: float
    released: bool = False
    renewals: int = 0

    def to_bytes(self) -> bytes:
        return dumps_canonical(
            {
                "holder": asdict(self.holder),
                "seconds": self.seconds,
                "released": self.released,
                "renewals": self.renewals,
            }
        )

    @classmethod
    def parse(cls, raw: bytes) -> LeaseRecord | None:
        """The lease, or None for anything ckptvault did not write (bounded parse)."""
        try:
            value = loads_bounded(raw, ".writer.lock", max_depth=4, max_bytes=MAX_LEASE_BYTES)
            holder = Holder(**value["holder"])
            seconds = float(value["seconds"])
            if not 1 <= seconds <= 3600 or not _well_typed(holder):
                return None
            return cls(holder, seconds, bool(value["released"]), int(value["renewals"]))
        except (FormatError, KeyError, TypeError, ValueError):
            return None


def _well_typed(holder: Holder) -> bool:
    numbers = (holder.pid, holder.start_ticks)
    texts = (holder.host, holder.boot_id, holder.pid_ns, holder.token, holder.since)
    return all(type(n) is int for n in numbers) and all(isinstance(t, str) for t in texts)


@dataclass(frozen=True)
class LeaseSnapshot:
    """The lease object as read: its first bytes, version and age."""

    raw: bytes  # at most the limit read
    size: int  # the whole object's size (-1 when unknown)
    etag: str
    age: float  # seconds since its last write, by the server's clock


class LeaseObject(Protocol):
    """The one object a lease lives in, as its backend reaches it. Each method raises
    :class:`ObjectStoreError` (:class:`ObjectPreconditionFailed` when its condition
    fails, :class:`ObjectNotFound` when the object is gone) and nothing else."""

    url: str  # for messages

    def create(self, data: bytes) -> str:
        """Create it holding ``data`` only if it does not exist; its new ETag."""

    def replace(self, data: bytes, etag: str) -> str:
        """Overwrite it with ``data`` only if its ETag is still ``etag``; the new ETag."""

    def read(self, limit: int) -> LeaseSnapshot | None:
        """Its first ``limit`` bytes, ETag and age; None when it does not exist."""


@dataclass(frozen=True)
class _Observed:
    """The lease as read: its record (None when unreadable), version and age."""

    record: LeaseRecord | None
    etag: str
    age: float  # seconds since its last write, by the server's clock


class _HeldLease:
    """A lease this process holds. Renewals happen under a mutex: the renewal thread
    and :meth:`ObjectWriterLease.confirm` must never spend the same ETag twice (the
    second would fail its condition and look like a takeover)."""

    def __init__(self, target: LeaseObject, record: LeaseRecord, etag: str) -> None:
        self.target = target
        self.record = record
        self.etag: str | None = etag
        self.lost: str | None = None  # why the lease is gone, once it is
        self.renewed_at = time.monotonic()
        self.mutex = threading.Lock()
        self.stop = threading.Event()

    def renew(self) -> None:
        """Renew now; :class:`ObjectStoreError` when that fails (``lost`` says when for good)."""
        with self.mutex:
            if self.etag is None:
                raise ObjectNotFound(
                    errno.ENOENT, self.lost or "the lease was released", "Released"
                )
            record = LeaseRecord(
                self.record.holder, self.record.seconds, False, self.record.renewals + 1
            )
            try:
                etag = self.target.replace(record.to_bytes(), self.etag)
            except (ObjectPreconditionFailed, ObjectNotFound):
                self.etag, self.lost = None, "another writer took the lease over or removed it"
                raise
            except ObjectStoreError as exc:
                if time.monotonic() - self.renewed_at > self.record.seconds:
                    self.etag = None
                    self.lost = f"it could not be renewed for {self.record.seconds:.0f} s ({exc})"
                raise
            self.record, self.etag = record, etag
            self.renewed_at = time.monotonic()

    def keep(self) -> None:
        """The renewal thread's body: renew every third of the lease until stopped or lost."""
        while not self.stop.wait(self.record.seconds / 3):
            try:
                self.renew()
            except ObjectStoreError as exc:
                if self.lost is not None:
                    logger.error("lost the writer lease %s: %s", self.target.url, self.lost)
                    return
                logger.warning("could not renew the writer lease (will retry): %s", exc)

    def release(self) -> None:
        """Mark the lease released (conditionally: never over someone else's)."""
        self.stop.set()
        with self.mutex:
            etag, self.etag = self.etag, None
            self.lost = self.lost or "it was released"
            if etag is None:
                return
            record = LeaseRecord(
                self.record.holder, self.record.seconds, True, self.record.renewals
            )
            try:
                self.target.replace(record.to_bytes(), etag)
            except ObjectStoreError as exc:  # taken over meanwhile, or unreachable: it expires
                logger.debug("releasing %s: %s", self.target.url, exc)


class ObjectWriterLease:
    """The single-writer lease of one store object (see the module docstring)."""

    def __init__(self, target: LeaseObject, location: str, seconds: float) -> None:
        self.target = target
        self.location = location
        self.seconds = seconds
        self._held: _HeldLease | None = None

    @property
    def held(self) -> bool:
        return self._held is not None and self._held.etag is not None

    def acquire(self) -> None:
        """Take the lease (idempotent); ``StoreLockedError`` naming a live holder."""
        if self.held:
            return
        self.release()  # forget a lease that was lost
        record = LeaseRecord(Holder.current(secrets.token_hex(16)), self.seconds)
        for _attempt in range(_TAKE_ATTEMPTS):
            etag = self._try_create(record) or self._try_take_over(record)
            if etag is not None:
                held = _HeldLease(self.target, record, etag)
                threading.Thread(target=held.keep, name="ckptvault-lease", daemon=True).start()
                self._held = held
                # A store dropped without release_writer() must not keep the lease. Not
                # at interpreter exit: an unreachable endpoint would stall the exit, and
                # an exited holder's lease is provably dead here, expired elsewhere.
                self._finalizer = weakref.finalize(self, held.release)
                self._finalizer.atexit = False
                return
        raise StoreLockedError(
            f"the writer lease of store {self.location} keeps changing hands; another writer "
            "is starting at the same moment. Try again"
        )

    def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._finalizer.detach()
            held.release()

    def check_held(self) -> _HeldLease:
        """The lease this store object took; ``SaveFailedError`` when it took none."""
        if self._held is None:
            raise SaveFailedError(
                f"publishing into {self.location} needs the store's writer lease; take it with "
                "acquire_writer() first. Nothing was published"
            )
        return self._held

    def confirm(self) -> None:
        """Renew the lease right now; ``SaveFailedError`` when it is not ours any more."""
        held = self.check_held()
        try:
            held.renew()
        except ObjectStoreError as exc:
            raise SaveFailedError(
                f"this writer lost the writer lease of {self.location}: {held.lost or exc}. "
                "Refusing to publish (another writer may own the store now); nothing was "
                "published and earlier generations are intact"
            ) from exc

    # -- taking ------------------------------------------------------------------------

    def _try_create(self, record: LeaseRecord) -> str | None:
        try:
            return self.target.create(record.to_bytes())
        except ObjectPreconditionFailed:
            return None

    def _try_take_over(self, record: LeaseRecord) -> str | None:
        """The new ETag, None when the lease changed meanwhile (look again), or
        ``StoreLockedError`` when a live holder has it."""
        observed = self._observe()
        if observed is None:
            return None  # removed meanwhile: create it again
        if not self._may_take_over(observed):
            raise StoreLockedError(self._locked_message(observed))
        try:
            etag = self.target.replace(record.to_bytes(), observed.etag)
        except (ObjectPreconditionFailed, ObjectNotFound):
            return None
        previous = observed.record
        if previous is not None and not previous.released:
            logger.warning(
                "took over the writer lease of %s from %s (expired or its process is gone)",
                self.location,
                previous.holder.describe(),
            )
        return etag

    def _observe(self) -> _Observed | None:
        snapshot = self.target.read(MAX_LEASE_BYTES)
        if snapshot is None:
            return None
        fits = 0 <= snapshot.size <= MAX_LEASE_BYTES or snapshot.size < 0
        record = LeaseRecord.parse(snapshot.raw) if fits else None
        return _Observed(record, snapshot.etag, snapshot.age)

    def _may_take_over(self, observed: _Observed) -> bool:
        record = observed.record
        if record is None:
            # No ckptvault writer wrote this (leases are written whole, atomically):
            # replaced, as POSIX replaces a link planted where its lock file belongs.
            logger.warning("%s is not a ckptvault lease; replacing it", self.target.url)
            return True
        return record.released or observed.age > record.seconds or record.holder.provably_dead()

    def _locked_message(self, observed: _Observed) -> str:
        record = observed.record
        holder = record.holder.describe() if record else "holder unknown"
        left = (record.seconds if record else self.seconds) - observed.age
        return (
            f"store {self.location} is being written by another live process ({holder}; its "
            f"lease runs out in {max(left, 0):.0f} s unless renewed); ckptvault allows one "
            "writer per store. Stop that process, or save this run under a different prefix."
        )
