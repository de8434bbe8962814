"""The S3 backend's own rules, below the manager: layout, part sizes, URLs, the
conditional-write probe, the writer lease, pinned reads, cleanup, deletion, records.

Everything runs against a real S3-protocol server on loopback (``s3_server.py``),
except the pure functions; the one simulated fault is a backend that ignores
``If-None-Match``, made by stripping that header from the probe's client call.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest
from botocore.exceptions import ClientError

from ckptvault.errors import SaveFailedError, StoreLockedError, UnsafeEntryError, UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME, new_generation_id
from ckptvault.storage import open_store
from ckptvault.storage.objects.layout import (
    OWN_PREFIX,
    ObjectLayout,
    classify_entries,
    spread_digit,
)
from ckptvault.storage.s3.options import S3Options, parse_s3_url
from ckptvault.storage.s3.read import S3ObjectReader, head_object
from ckptvault.storage.s3.store import S3Store
from ckptvault.storage.s3.upload import MAX_PARTS, part_size_for
from support.s3_saboteurs import fresh_bucket_store
from support.s3_server import new_bucket, s3_client
from support.seaweedfs_server import s3_server_of

MiB = 1024 * 1024
GiB = 1024 * MiB
SMALL_PARTS = S3Options(part_size=5 * MiB)


def publish(store: S3Store, step: int, files: dict[str, bytes], **kwargs: object):
    area = store.begin_generation(str(kwargs.get("generation_id") or new_generation_id()))
    try:
        for name, data in files.items():
            sink = area.create_file(name)
            sink.write(data)
            sink.commit()
        return area.publish(step, b'{"manifest": true}', None)
    except BaseException:
        area.abort()
        raise


def keys(store: S3Store, below: str = "") -> list[str]:
    return sorted(str(o["Key"]) for o in store.client.list_objects(store.layout.prefix + below))


def uploads(store: S3Store) -> list[dict]:
    return list(store.client.list_uploads(store.layout.prefix))


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- pure rules ----------------------------------------------------------------------


@pytest.mark.parametrize("first_part", [5 * MiB, 16 * MiB, 64 * MiB])
def test_a_terabyte_fits_in_fewer_than_ten_thousand_growing_parts(first_part: int):
    total, parts = 0, 0
    while total < 10**12:  # 1 TB, size unknown in advance: parts grow by themselves
        parts += 1
        size = part_size_for(parts, first_part)
        assert 5 * MiB <= size <= 5 * GiB
        total += size
    assert parts < MAX_PARTS
    assert part_size_for(1, first_part) == first_part
    assert part_size_for(1001, first_part) == min(2 * first_part, 5 * GiB)
    assert part_size_for(MAX_PARTS, 5 * GiB) == 5 * GiB  # capped at S3's maximum


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        ("s3://bucket-1/run42", "bucket-1", "run42/"),
        ("s3://bucket-1/a/b/", "bucket-1", "a/b/"),
        ("s3://bucket-1", "bucket-1", ""),
    ],
)
def test_s3_urls(url: str, bucket: str, prefix: str):
    location = parse_s3_url(url)
    assert (location.bucket, location.prefix) == (bucket, prefix)
    assert location.url == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/../escape",
        "s3://bucket/a//b",
        "s3://bucket/.hidden",
        "s3://bucket/a?versionId=1",
        "s3://key:secret@bucket/a",
        "s3://Not_A_Bucket/a",
        "s3:///prefix",
    ],
)
def test_s3_urls_that_could_leave_the_prefix_are_refused(url: str):
    with pytest.raises(UsageError):
        parse_s3_url(url)


def test_s3_options_are_validated(tmp_path):
    for bad in (
        {"part_size": 4 * MiB},
        {"part_size": 6 * GiB},
        {"max_concurrency": 0},
        {"object_lock_days": 0},
    ):
        with pytest.raises(UsageError):
            S3Options(**bad)  # type: ignore[arg-type]
    assert S3Options.from_keywords() is None
    assert S3Options.from_keywords(part_size=8 * MiB) == S3Options(part_size=8 * MiB)
    with pytest.raises(UsageError, match="s3:// stores only"):
        open_store(tmp_path / "local", s3=S3Options())


def test_listing_reports_every_object_that_is_not_where_its_writer_puts_it():
    generation_id = new_generation_id()
    home, rank0 = spread_digit(generation_id, 3), spread_digit(generation_id, 0)
    other = next(d for d in "0123456789abcdef" if d not in (home, rank0))
    listings: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for place, rest in [
        (OWN_PREFIX, MANIFEST_NAME),
        (OWN_PREFIX, SIGNATURE_NAME),
        (OWN_PREFIX, "beside.bin"),
        (OWN_PREFIX, ""),  # a folder marker: not an entry
        (home, "r00003-000.safetensors"),
        (home, "r00003-001.safetensors/x"),
        (other, "r00003-002.safetensors"),
        (home, "r00003-003.safetensors"),
        (other, "r00003-003.safetensors"),
        (rank0, "state.json"),
        (rank0, ".hidden"),
        (rank0, ".."),
        (rank0, "a b"),
        (rank0, MANIFEST_NAME),
    ]:
        listings[place].append((rest, len(rest)))
    entries = classify_entries(generation_id, listings)
    safe = {name for name, entry in entries.items() if entry.unsafe is None}
    assert safe == {SIGNATURE_NAME, "r00003-000.safetensors", "state.json"}
    assert entries["r00003-000.safetensors"].size == len("r00003-000.safetensors")
    reasons = {name: str(entry.unsafe) for name, entry in entries.items() if entry.unsafe}
    assert "beside the manifest" in reasons["beside.bin"]
    assert "nested" in reasons["r00003-001.safetensors"]
    assert f"not data/{home}/" in reasons["r00003-002.safetensors"]
    assert "stored 2 times" in reasons["r00003-003.safetensors"]
    assert "stored 2 times" in reasons[MANIFEST_NAME]  # beside the manifest and in data/
    for name in (".hidden", "..", "a b"):
        assert "not a plain file name" in reasons[name]


def test_keys_are_built_only_from_validated_names():
    layout = ObjectLayout("run/")
    generation_id = new_generation_id()
    for bad in ("../x", "/abs", ".hidden", "a/b", MANIFEST_NAME, ""):
        with pytest.raises(UsageError):
            layout.data_key(generation_id, bad)
    with pytest.raises(UsageError):
        layout.data_key("not-an-id", "w.bin")
    key = layout.data_key(generation_id, "r00007-000.safetensors")
    assert (
        key == f"run/data/{spread_digit(generation_id, 7)}/{generation_id}/r00007-000.safetensors"
    )


# -- against the server ---------------------------------------------------------------


def test_files_larger_than_a_part_go_up_as_multipart_and_stream_back(s3_endpoint: str):
    store = fresh_bucket_store(options=SMALL_PARTS)
    store.acquire_writer()
    data = bytes(range(256)) * (48 * 1024) + b"tail"  # 12 MiB + 4: three parts
    ref = publish(store, 1, {"big.bin": data, "small.bin": b"small"})
    generation_id = ref.generation_id
    head = store.client.call("head_object", store.layout.data_key(generation_id, "big.bin"))
    assert str(head["ETag"]).endswith('-3"')  # a completed multipart upload of 3 parts
    with store.open_file(ref, "big.bin") as stream:
        block, pieces = bytearray(4 * MiB), []
        while count := stream.readinto(block):
            pieces.append(bytes(block[:count]))
    assert b"".join(pieces) == data
    assert store.read_range(ref, "big.bin", 5 * MiB - 3, 10) == data[5 * MiB - 3 : 5 * MiB + 7]
    assert uploads(store) == []
    store.release_writer()


def test_an_object_replaced_while_it_is_read_fails_the_read(s3_endpoint: str):
    store = fresh_bucket_store(options=SMALL_PARTS)
    store.acquire_writer()
    ref = publish(store, 1, {"w.bin": b"a" * (4 * MiB)})
    key = store.layout.data_key(ref.generation_id, "w.bin")
    stream = S3ObjectReader(
        store.client, head_object(store.client, key), store.read_pool, MiB, read_ahead=1
    )
    assert stream.read(MiB) == b"a" * MiB
    s3_client(s3_endpoint).put_object(Bucket=store.client.bucket, Key=key, Body=b"b" * (4 * MiB))
    with pytest.raises(OSError, match="replaced while it was being read"):
        stream.read()  # the next range may already be in; the ones after cannot be
    stream.close()


def test_unsafe_names_planted_in_a_generation_are_listed_and_never_served(s3_endpoint: str):
    store = fresh_bucket_store()
    store.acquire_writer()
    ref = publish(store, 1, {"w.bin": b"weights"})
    raw, bucket = s3_client(s3_endpoint), store.client.bucket
    data_prefix = store.layout.data_prefix(spread_digit(ref.generation_id, 0), ref.generation_id)
    for planted in (".hidden", "../escape", "a b"):
        raw.put_object(Bucket=bucket, Key=data_prefix + planted, Body=b"planted")
    raw.put_object(Bucket=bucket, Key=store.layout.generation_prefix(ref.name) + "x.bin", Body=b"")
    entries = store.list_entries(ref)
    assert entries["w.bin"].unsafe is None and entries[MANIFEST_NAME].unsafe is None
    for name in (".hidden", "..", "a b", "x.bin"):
        assert entries[name].unsafe, name
        with pytest.raises(UnsafeEntryError):
            store.read_bytes(ref, name, MiB)


def test_the_probe_refuses_a_backend_that_ignores_conditional_writes(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
):
    store = fresh_bucket_store()
    real_call, probes = store.client.call, []

    def ignores_if_none_match(operation: str, key: str | None = None, **params: object):
        if key is not None and "/.probe/" in key and operation == "put_object":
            probes.append(key)
            params.pop("IfNoneMatch", None)  # what such a backend does with the header
        return real_call(operation, key, **params)

    monkeypatch.setattr(store.client, "call", ignores_if_none_match)
    store.acquire_writer()
    for _attempt in range(2):
        with pytest.raises(SaveFailedError, match="ignores conditional writes"):
            store.begin_generation(new_generation_id())
    assert len(probes) == 2  # probed once per store: the verdict is kept
    assert store.list_generations() == [] and keys(store, ".probe/") == []
    store.release_writer()


def test_a_writer_that_lost_its_lease_refuses_to_publish(s3_endpoint: str):
    paused = fresh_bucket_store(options=S3Options(lease_seconds=2))
    paused.acquire_writer()
    held = paused.writer_lease._held
    assert held is not None
    held.stop.set()  # a paused process: it stops renewing
    area = paused.begin_generation(new_generation_id())
    sink = area.create_file("w.bin")
    sink.write(b"paused writer")
    sink.commit()

    other = S3Store(paused.location)
    with pytest.raises(StoreLockedError, match="pid"):
        other.acquire_writer()  # the lease is still live
    time.sleep(3.5)
    other.acquire_writer()  # expired: taken over
    winner = publish(other, 2, {"w.bin": b"new writer"})
    with pytest.raises(SaveFailedError, match="lost the writer lease"):
        area.publish(1, b'{"late": true}')
    assert other.list_generations() == [winner]
    assert all(winner.generation_id in key for key in keys(paused, "data/"))
    other.release_writer()


def test_two_writers_cannot_both_hold_the_lease_and_release_hands_it_over(s3_endpoint: str):
    first = fresh_bucket_store()
    second = S3Store(first.location)
    first.acquire_writer()
    with pytest.raises(StoreLockedError) as raised:
        second.acquire_writer()
    assert "pid" in str(raised.value) and first.location in str(raised.value)
    with pytest.raises(SaveFailedError, match="needs the store's writer lease"):
        publish(second, 1, {"w.bin": b"without the lease"})
    first.release_writer()
    second.acquire_writer()
    publish(second, 2, {"w.bin": b"with the lease"})
    assert [ref.step for ref in first.list_generations()] == [2]
    second.release_writer()


def test_cleanup_keeps_an_upload_that_is_making_progress(each_s3_endpoint: str):
    store = fresh_bucket_store(options=SMALL_PARTS)
    store.acquire_writer()
    hours_ago = datetime.now(timezone.utc) - timedelta(hours=3)
    # Begun three hours ago, a large file still uploading: its newest part is fresh.
    busy = store.begin_generation(new_generation_id(hours_ago))
    sink = busy.create_file("r00000-000.safetensors")
    sink.write(b"x" * (6 * MiB))
    wait_until(
        lambda: any(store.client.list_parts(u["Key"], u["UploadId"]) for u in uploads(store))
    )
    # Abandoned by a crash: one object, no upload.
    dead_id = new_generation_id(hours_ago - timedelta(seconds=1))
    dead = store.begin_generation(dead_id)
    leftover = dead.create_file("r00000-000.safetensors")
    leftover.write(b"leftover")
    leftover.commit()

    assert store.remove_stale_staging() == []  # no age: nothing is provably dead
    assert store.remove_stale_staging(older_than=600) == []  # the dead one is fresh too
    assert len(uploads(store)) == 1
    sink.write(b"y" * MiB)
    sink.commit()
    ref = busy.publish(1, b'{"manifest": true}')
    assert store.remove_stale_staging(older_than=0) == [dead_id]
    assert store.list_generations() == [ref] and uploads(store) == []
    assert all(ref.generation_id in key for key in keys(store, "data/"))
    assert store.read_bytes(ref, "r00000-000.safetensors", 8 * MiB)[-2:] == b"yy"
    store.release_writer()


def test_cleanup_at_a_bucket_root_leaves_other_applications_keys_under_data(
    each_s3_endpoint: str, request: pytest.FixtureRequest
):
    """Red-team finding A02: a store at a bucket's root shares ``data/`` with whatever
    else uses the bucket. Cleanup touches only keys this store makes, exactly
    ``data/<spread digit>/<generation id>/<safe name>``: another application's uploads
    and objects there are never aborted or deleted, however old."""
    bucket = new_bucket(each_s3_endpoint)
    store = S3Store(f"s3://{bucket}")
    assert store.layout.prefix == "" and store.layout.data_root == "data/"
    raw = s3_client(each_s3_endpoint)
    store.acquire_writer()
    ref = publish(store, 1, {"w.bin": b"published"})
    hours_ago = datetime.now(timezone.utc) - timedelta(hours=3)
    lookalike = new_generation_id(hours_ago)  # a valid id, in keys ckptvault never makes
    right = spread_digit(lookalike, 0)
    wrong = next(d for d in "0123456789abcdef" if d != right)
    dotted = f"data/{right}/{ref.generation_id}/x/../w.bin"
    foreign = [
        "data/videos/big.mp4",
        "data/0/other-app/file",
        f"data/{right}/{lookalike}/nested/file",  # below a file name
        f"data/{right}/{lookalike}/.hidden",  # not a safe name
        f"data/{wrong}/{lookalike}/w.bin",  # not where this store puts w.bin
        dotted,
    ]
    if s3_server_of(request) == "seaweedfs":
        # Measured: SeaweedFS refuses keys with a "." or ".." segment (InvalidRequest,
        # on PutObject and CreateMultipartUpload); AWS S3 and moto store them as given.
        # Nobody can plant this one there, so there is nothing to leave alone.
        with pytest.raises(ClientError, match="InvalidRequest"):
            raw.put_object(Bucket=bucket, Key=dotted, Body=b"someone else's")
        foreign.remove(dotted)
    foreign_uploads = {}
    for key in [*foreign, "logs/other.txt"]:
        upload = raw.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        foreign_uploads[key] = upload
        raw.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x")
        raw.put_object(Bucket=bucket, Key=key, Body=b"someone else's")
    # This store's own leftovers, which cleanup is for: a dead attempt's object and
    # upload, and an upload left behind by the published generation.
    dead_id = new_generation_id(hours_ago - timedelta(seconds=1))
    dead = store.begin_generation(dead_id)
    leftover = dead.create_file("r00000-000.safetensors")
    leftover.write(b"leftover")
    leftover.commit()
    for key in (
        store.layout.data_key(dead_id, "r00001-000.safetensors"),
        store.layout.data_key(ref.generation_id, "r00002-000.safetensors"),
    ):
        raw.create_multipart_upload(Bucket=bucket, Key=key)

    removed = store.remove_stale_staging(older_than=0)

    assert dead_id in removed and not set(removed) & set(foreign_uploads)
    left = {(str(u["Key"]), str(u["UploadId"])) for u in uploads(store)}
    assert left == set(foreign_uploads.items())  # ours aborted, everyone else's kept
    for key in [*foreign, "logs/other.txt"]:
        assert raw.get_object(Bucket=bucket, Key=key)["Body"].read() == b"someone else's"
    assert not [key for key in keys(store, "data/") if dead_id in key]
    assert store.list_generations() == [ref]
    assert store.read_bytes(ref, "w.bin", 100) == b"published"
    store.release_writer()


def test_delete_generation_removes_the_manifest_first_then_every_object(each_s3_endpoint: str):
    store = fresh_bucket_store()
    store.acquire_writer()
    kept = publish(store, 1, {"w.bin": b"kept"})
    doomed = publish(store, 2, {"w.bin": b"doomed", "r00001-000.safetensors": b"rank 1"})
    deleted: list[str] = []  # instrumentation on the real client: every delete, in order

    def record(params: dict, **_kwargs: object) -> None:
        objects = params.get("Delete", {}).get("Objects", [{"Key": params.get("Key")}])
        deleted.extend(str(o["Key"]) for o in objects)

    store.client.raw.meta.events.register("provide-client-params.s3.DeleteObject", record)
    store.client.raw.meta.events.register("provide-client-params.s3.DeleteObjects", record)
    store.delete_generation(doomed)
    store.delete_generation(doomed)  # idempotent
    assert deleted[:2] == [
        store.layout.generation_key(doomed.name, MANIFEST_NAME),
        store.layout.generation_key(doomed.name, SIGNATURE_NAME),
    ]
    assert store.layout.data_key(doomed.generation_id, "r00001-000.safetensors") in deleted
    assert store.list_generations() == [kept]
    assert not [key for key in keys(store) if doomed.generation_id in key]
    assert store.read_bytes(kept, "w.bin", 100) == b"kept"
    store.release_writer()


def test_records_round_trip_and_planted_ones_are_skipped(s3_endpoint: str):
    store = fresh_bucket_store()
    store.put_record("pinned", "gen-1", {"by": "ops", "step": 1})
    store.put_record("pinned", "gen-1", {"by": "ops", "step": 2})  # replaced
    store.put_record("pinned", "gen-2", {"step": 3})
    raw, bucket = s3_client(s3_endpoint), store.client.bucket
    prefix = store.layout.records_prefix("pinned")
    raw.put_object(Bucket=bucket, Key=prefix + "deep.json", Body=b"[" * 100 + b"]" * 100)
    raw.put_object(Bucket=bucket, Key=prefix + "huge.json", Body=b" " * (65 * 1024) + b"{}")
    raw.put_object(Bucket=bucket, Key=prefix + "nested/x.json", Body=b"{}")
    raw.put_object(Bucket=bucket, Key=prefix + ".hidden.json", Body=b"{}")
    assert store.list_records("pinned") == {"gen-1": {"by": "ops", "step": 2}, "gen-2": {"step": 3}}
    store.delete_record("pinned", "gen-1")
    store.delete_record("pinned", "gen-1")  # missing is fine
    assert set(store.list_records("pinned")) == {"gen-2"}
    assert store.list_records("deleted") == {}
    with pytest.raises(UsageError):
        store.put_record("pinned", "../escape", {})


def test_a_manifest_put_answered_exists_that_cannot_be_read_back_keeps_the_data(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
):
    """The manifest PUT lands, its response is lost, boto3's retry answers 412, and
    the read that tells "ours" from "someone else's" fails too. That was taken for a
    lost race: the attempt deleted its data under the manifest it had just published
    (found on Azure by the hostile review; S3 had the same rule). Unknown keeps it."""
    from ckptvault.storage.s3.client import S3PreconditionFailed

    store = fresh_bucket_store()
    store.acquire_writer()
    area = store.begin_generation(new_generation_id())
    sink = area.create_file("r00000-000.safetensors")
    sink.write(b"d" * 1000)
    sink.commit()
    put_new = store.client.put_new

    def retried_after_a_lost_response(key: str, data: bytes, **params: object) -> object:
        result = put_new(key, data, **params)
        if key.endswith("/" + MANIFEST_NAME):
            monkeypatch.setattr(store.client, "holds_exactly", lambda *_: None)
            raise S3PreconditionFailed(17, f"put_object {key}: 412 (retried)", "PreconditionFailed")
        return result

    monkeypatch.setattr(store.client, "put_new", retried_after_a_lost_response)
    with pytest.raises(SaveFailedError, match="unknown"):
        area.publish(3, b'{"manifest": 3}')
    monkeypatch.undo()
    (ref,) = store.list_generations()
    assert store.read_bytes(ref, "r00000-000.safetensors", MiB) == b"d" * 1000
    store.release_writer()
