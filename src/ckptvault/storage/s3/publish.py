"""Publishing on S3: the staging area of one save attempt and the publish rule.

S3 has no rename and no transaction across keys, so a generation becomes visible
by one object: its manifest. :class:`ConditionalManifestPut` publishes in this order:

1. every data object exists (each file was committed: its PUT or
   CompleteMultipartUpload returned, and S3 reads are strongly consistent after that);
2. with ``object_lock_days``, every data object is put under retention, when the
   store's lock rule takes this step (:class:`ObjectRetention`);
3. ``manifest.sig`` (if any) is written, conditionally;
4. the writer lease is renewed — a writer that lost it refuses to publish;
5. ``manifest.json`` is written with ``If-None-Match: *``. Success is the publish;
   ``412 Precondition Failed`` means someone else published that generation, and
   this attempt fails and removes what it wrote.

A crash anywhere before step 5 leaves no manifest, so no generation: readers never
see the attempt, and ``remove_stale_staging`` deletes its objects later. That rule
rests on the backend honouring ``If-None-Match``; each store probes it once
(:func:`probe_conditional_writes`) and refuses to save where it is ignored.
"""

from __future__ import annotations

import errno
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from ckptvault.errors import SaveFailedError, UsageError
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    GenerationName,
    generation_dirname,
    parse_generation_dirname,
)
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.objects.layout import ObjectLayout
from ckptvault.storage.objects.lease import ObjectWriterLease
from ckptvault.storage.objects.staging import ObjectStagingArea
from ckptvault.storage.retained import LockRule
from ckptvault.storage.s3.client import S3Client, S3Error, S3PreconditionFailed
from ckptvault.storage.s3.options import S3Options
from ckptvault.storage.s3.upload import PartUploader, S3WritableFile

logger = logging.getLogger("ckptvault")

_UNSUPPORTED = {"NotImplemented", "InvalidArgument", "InvalidRequest", "501"}


class ConditionalWritesUnsupported(SaveFailedError):
    """The backend does not honour ``If-None-Match: *``: a verdict about the backend,
    kept for the store's lifetime (unlike a network error during the probe)."""


def probe_conditional_writes(client: S3Client, layout: ObjectLayout) -> None:
    """Check that the backend refuses a second ``If-None-Match: *`` PUT of one key;
    ``SaveFailedError`` when it does not (publishing would not be safe there)."""
    key = layout.probe_key(secrets.token_hex(16))
    try:
        client.call("put_object", key, Body=b"first", IfNoneMatch="*")
        try:
            client.call("put_object", key, Body=b"second", IfNoneMatch="*")
        except S3PreconditionFailed:
            return  # refused, as it must be
        raise ConditionalWritesUnsupported(
            f"{client.url(key)}: this S3 backend ignores conditional writes (If-None-Match: *), "
            "so a generation could be published twice or replaced; ckptvault refuses to save "
            "there. Use a backend that supports conditional writes (AWS S3, recent MinIO/Ceph)"
        )
    except S3Error as exc:
        if exc.code in _UNSUPPORTED:
            raise ConditionalWritesUnsupported(
                f"{client.url(key)}: this S3 backend does not support conditional writes "
                f"({exc.code}); ckptvault refuses to publish there"
            ) from exc
        raise SaveFailedError(f"probing conditional writes: {exc}") from exc
    finally:
        try:
            client.call("delete_object", key)
        except S3Error as exc:
            logger.debug("could not delete the probe %s: %s", client.url(key), exc)


class ObjectRetention:
    """``object_lock_days``: published objects under Object Lock (GOVERNANCE mode).

    Which generations publish locks is ``rule`` (step -> lock it), installed by the
    manager from its retention policy (milestones: ``keep_every``); None locks every
    generation. A generation pinned later is locked by :meth:`lock_now`.
    """

    def __init__(self, client: S3Client, days: int | None) -> None:
        self.client = client
        self.days = days
        self.rule: LockRule | None = None
        self._checked = False

    def check_bucket(self) -> None:
        """``UsageError`` when retention is asked for but the bucket cannot hold it."""
        if self.days is None or self._checked:
            return
        try:
            response = self.client.call("get_object_lock_configuration")
            enabled = response.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled")
        except S3Error as exc:
            if exc.code not in ("ObjectLockConfigurationNotFoundError", "404"):
                raise
            enabled = None
        if enabled != "Enabled":
            raise UsageError(
                f"object_lock_days={self.days}: bucket {self.client.bucket} does not have "
                "Object Lock enabled, so published objects cannot be put under retention. "
                "Use a bucket created with Object Lock, or drop object_lock_days"
            )
        self._checked = True

    def locks(self, step: int) -> bool:
        """Whether publishing a generation of ``step`` puts it under retention."""
        return self.days is not None and (self.rule is None or self.rule(step))

    def until(self) -> datetime:
        assert self.days is not None
        return datetime.now(timezone.utc) + timedelta(days=self.days)

    def object_params(self, step: int) -> dict[str, Any]:
        """PUT parameters that lock a new object of a generation of ``step``, or none."""
        if not self.locks(step):
            return {}
        return {"ObjectLockMode": "GOVERNANCE", "ObjectLockRetainUntilDate": self.until()}

    def apply(self, keys: list[str], pool: ThreadPoolExecutor, step: int) -> None:
        """Put existing objects of a generation of ``step`` under retention (in parallel)."""
        if self.locks(step):
            self._lock(keys, pool, self.until(), extend_only=False)

    def lock_now(self, keys: list[str], pool: ThreadPoolExecutor) -> datetime | None:
        """Put published objects under retention for ``object_lock_days`` from now
        (a pin), never shortening a longer one; the date, or None without days."""
        if self.days is None:
            return None
        self.check_bucket()
        until = self.until()
        self._lock(keys, pool, until, extend_only=True)
        return until

    def _lock(
        self, keys: list[str], pool: ThreadPoolExecutor, until: datetime, extend_only: bool
    ) -> None:
        retention = {"Mode": "GOVERNANCE", "RetainUntilDate": until}

        def lock(key: str) -> None:
            if extend_only:
                current = self.client.call("head_object", key).get("ObjectLockRetainUntilDate")
                if isinstance(current, datetime) and current >= until:
                    return  # already held longer: GOVERNANCE forbids shortening it
            self.client.call("put_object_retention", key, Retention=retention)

        for _done in pool.map(lock, keys):
            pass


class _Staging(Protocol):
    """What a staging area needs of an S3 store (:class:`~ckptvault.storage.s3.store.S3Store`,
    which imports this module): its client, keys, options, pools, lease, Object Lock
    rule and publish rule."""

    @property
    def location(self) -> str: ...

    @property
    def client(self) -> S3Client: ...

    @property
    def layout(self) -> ObjectLayout: ...

    @property
    def options(self) -> S3Options: ...

    @property
    def uploader(self) -> PartUploader: ...

    @property
    def read_pool(self) -> ThreadPoolExecutor: ...

    @property
    def writer_lease(self) -> ObjectWriterLease: ...

    @property
    def retention(self) -> ObjectRetention: ...

    @property
    def publish_rule(self) -> ConditionalManifestPut: ...

    def ref_for(self, name: GenerationName) -> GenerationRef: ...

    def require_conditional_writes(self) -> None: ...


class S3StagingArea(ObjectStagingArea):
    """The data objects of one save attempt, under ``data/<x>/<generation id>/``:
    multipart uploads, deleted in batches, published by :class:`ConditionalManifestPut`."""

    store: _Staging

    def __init__(self, store: _Staging, generation_id: str, joined: bool = False) -> None:
        super().__init__(store, generation_id, joined)

    def create_file(self, name: str) -> S3WritableFile:
        file: S3WritableFile = super().create_file(name)
        return file

    def _new_file(self, key: str) -> S3WritableFile:
        store = self.store
        return S3WritableFile(
            store.client, store.uploader, key, store.options.part_size, self.note_written
        )

    def _delete(self, keys: list[str]) -> None:
        self.store.client.delete_keys(keys)

    def _publish(self, step: int, manifest: bytes, signature: bytes | None) -> GenerationRef:
        return self.store.publish_rule.publish(self, step, manifest, signature)

    def read_staged(self, name: str, limit: int) -> bytes:
        key = self.store.layout.data_key(self.generation_id, name)
        data, _response = self.store.client.get_bytes(key, Range=f"bytes=0-{limit}")
        if len(data) > limit:  # one byte past the limit was asked for, to tell
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        return data


class ConditionalManifestPut:
    """The S3 publish rule (see the module docstring)."""

    def publish(
        self, area: S3StagingArea, step: int, manifest: bytes, signature: bytes | None
    ) -> GenerationRef:
        store = area.store
        name = parse_generation_dirname(generation_dirname(step, area.generation_id))
        if name is None or name.step != step:
            raise UsageError(f"step {step!r} is not a step (an integer from 0 to 2**63-1)")
        unfinished = area.unfinished_files()
        if unfinished:
            raise SaveFailedError(
                f"{', '.join(unfinished)} of {area.location} are still being written; a "
                "generation is published only after every file is committed"
            )
        store.writer_lease.check_held()  # before writing anything more
        store.require_conditional_writes()
        store.retention.check_bucket()
        store.retention.apply(area.written_keys(), store.read_pool, step)
        lock = store.retention.object_params(step)
        if signature is not None:
            sig_key = store.layout.generation_key(name, SIGNATURE_NAME)
            store.client.put_new(sig_key, signature, accept_identical=True, **lock)
            area.note_written(sig_key)
        store.writer_lease.confirm()  # a writer that lost the lease must not publish
        manifest_key = store.layout.generation_key(name, MANIFEST_NAME)
        try:
            store.client.put_new(manifest_key, manifest, **lock)
        except S3Error as exc:
            # "Exists" (412) may be this very PUT, retried by boto3 after a lost
            # response: only the object's bytes tell it from someone else's.
            _after_uncertain_put(area, manifest_key, manifest, exc)
        return store.ref_for(name)


def _after_uncertain_put(area: S3StagingArea, key: str, manifest: bytes, exc: S3Error) -> None:
    """The manifest PUT failed, or found the object there: it may be this PUT that
    landed. Returns when the object holds exactly ``manifest`` (published after all);
    otherwise raises, and keeps the attempt's objects when it cannot tell (a published
    generation keeps its data: "exists" and then a failed read proves no lost race)."""
    client = area.store.client
    landed = client.holds_exactly(key, manifest)
    if landed is True:
        return
    if landed is False and isinstance(exc, S3PreconditionFailed):
        raise SaveFailedError(
            f"{client.url(key)} already exists: someone else published generation "
            f"{area.generation_id}. This save was abandoned and its objects removed; the "
            "published generation is untouched"
        ) from exc
    if landed is None:
        area.keep_written = True
        raise SaveFailedError(
            f"writing {client.url(key)} failed ({exc}) and whether it landed is unknown. The "
            "data objects were kept: if the manifest exists the generation is complete, "
            "otherwise remove_stale_staging removes them later"
        ) from exc
    raise SaveFailedError(f"publishing {client.url(key)}: {exc}; nothing was published") from exc
