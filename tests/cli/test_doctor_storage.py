"""``ckptvault doctor`` on the storage checkpoints actually live on: Lustre striping
(a fake ``lfs`` on PATH), NFS mount options (fake mount tables), the host memory
asynchronous staging needs (a fake small ``/proc/meminfo``) and an S3 bucket's
lifecycle rules (the moto server).

The machine is described to the doctor through the paths it reads, never by
patching the checks themselves: the mount table's path, ``lfs`` found on PATH, the
meminfo file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.cli import main
from ckptvault.io import memory_available
from ckptvault.ops.doctor import lustre
from ckptvault.ops.doctor.diagnose import Host, Places, RunPlan, diagnose
from ckptvault.ops.doctor.lifecycle import policy_horizon
from ckptvault.ops.doctor.mounts import Mount, mount_of
from ckptvault.ops.doctor.nfs import check_nfs
from ckptvault.storage import open_store
from support.s3_server import new_bucket, s3_client

GB = 10**9


def _found(findings: list) -> dict[str, dict]:
    return {f.check: f.to_json() for f in findings}


def _mountinfo(path: Path, *mounts: tuple[str, str, str, str]) -> Path:
    """A mountinfo file: ``(mount point, type, source, filesystem options)`` each."""
    lines = ["22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw"]
    for number, (point, kind, source, options) in enumerate(mounts, start=40):
        lines.append(
            f"{number} 22 0:{number} / {point} rw,relatime shared:1 - {kind} {source} {options}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "mnt" / "store"
    with cv.CheckpointManager(root, run_id="r", ledger=tmp_path / "state" / "ledger") as mgr:
        mgr.save(1, {"x": torch.ones(3)})
    return root


def _grow(root: Path, nbytes: int) -> None:
    """Make the store's generation list as ``nbytes`` (a sparse data file: the doctor
    goes by the listing's sizes, and reads no byte)."""
    data = next(p for p in root.glob("step-*/*") if p.name not in ("manifest.json", "manifest.sig"))
    os.truncate(data, nbytes)


# -- Lustre --------------------------------------------------------------------------


@pytest.fixture
def fake_lfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An ``lfs`` on PATH printing what the test says, per directory asked about."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "lfs"
    answers = tmp_path / "answers"
    answers.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/lfs-calls\n'
        f'case "$3" in */store) a={answers}/store;; *) a={answers}/mount;; esac\n'
        '[ -f "$a.sleep" ] && exec sleep 30\n'
        'cat "$a" 2>/dev/null\n'
        '[ -f "$a.err" ] && { cat "$a.err" >&2; exit 2; }\n'
        "exit 0\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def answer(store: str = "", mount: str = "", store_err: str | None = None) -> None:
        (answers / "store").write_text(store)
        (answers / "mount").write_text(mount)
        if store_err is not None:
            (answers / "store.err").write_text(store_err)

    answer.calls = tmp_path / "lfs-calls"  # type: ignore[attr-defined]
    answer.answers = answers  # type: ignore[attr-defined]
    return answer


def _lustre_host(tmp_path: Path) -> Host:
    point = str(tmp_path / "mnt")
    return Host(
        _mountinfo(tmp_path / "mountinfo", (point, "lustre", "10.0.0.1@o2ib:/scratch", "rw,flock"))
    )


DIRECTORY_COUNT_1 = (
    "stripe_count:  1 stripe_size:   1048576 pattern:       raid0 stripe_offset: -1\n"
)
FILE_COUNT_4 = "lmm_stripe_count:  4\nlmm_stripe_size:   1048576\nlmm_pattern:       raid0\n"
COMPOSITE_ALL = (
    "  lcm_layout_gen:    0\n  lcm_entry_count:   2\n"
    "    lcme_extent.e_start: 0\n    lcme_extent.e_end:   67108864\n"
    "      stripe_count:  1       stripe_size:   1048576       pattern:       raid0\n\n"
    "    lcme_extent.e_start: 67108864\n    lcme_extent.e_end:   EOF\n"
    "      stripe_count:  -1       stripe_size:   1048576       pattern:       raid0\n"
)


def test_lustre_one_stripe_under_big_generations_warns_with_the_command(tmp_path, store, fake_lfs):
    host = _lustre_host(tmp_path)
    fake_lfs(store=DIRECTORY_COUNT_1)
    found = _found(diagnose(open_store(store), Places(), host=host))["store Lustre striping"]
    assert found["status"] == "ok" and "fine for the generations here" in found["detail"]

    _grow(store, 2 * GB)
    found = _found(diagnose(open_store(store), Places(), host=host))["store Lustre striping"]
    assert found["status"] == "warn" and "single OST" in found["detail"]
    assert found["fix"].startswith(f"lfs setstripe -c -1 {store} ")
    assert "seed 001" in found["fix"] and "created afterwards" in found["fix"]
    assert f"getstripe -d {store}" in fake_lfs.calls.read_text()  # the directory only, no walk

    # No layout of its own: the filesystem default (the mount's root) decides.
    fake_lfs(store="", mount=DIRECTORY_COUNT_1)
    found = _found(diagnose(open_store(store), Places(), host=host))["store Lustre striping"]
    assert found["status"] == "warn" and "filesystem default" in found["detail"]


@pytest.mark.parametrize(
    ("output", "detail"),
    [(FILE_COUNT_4, "over 4 OSTs"), (COMPOSITE_ALL, "every available OST")],
)
def test_lustre_striped_stores_pass(tmp_path, store, fake_lfs, output, detail):
    fake_lfs(store=output)
    found = lustre.check_lustre(store, mount_of(store, _lustre_host(tmp_path).mountinfo), 5 * GB)
    assert [(f.status, detail in f.detail) for f in found] == [("ok", True)]


def test_lustre_output_it_cannot_read_or_a_failing_lfs_is_reported_not_raised(
    tmp_path, store, fake_lfs, monkeypatch
):
    mount = mount_of(store, _lustre_host(tmp_path).mountinfo)
    assert mount is not None and mount.fstype == "lustre"
    fake_lfs(store="lfs: \x1b[31mstripe_count: lots\n\x00\xff garbage", mount="???")
    (found,) = lustre.check_lustre(store, mount, 5 * GB)
    assert found.status == "skip" and "shows no stripe count" in found.detail

    fake_lfs(store_err="error: getstripe: '/x' is not on a Lustre filesystem: Inappropriate ioctl")
    (found,) = lustre.check_lustre(store, mount, 5 * GB)
    assert found.status == "skip" and "failed (exit 2)" in found.detail
    assert "Inappropriate ioctl" in found.detail

    (fake_lfs.answers / "store.err").unlink()
    (fake_lfs.answers / "store.sleep").write_text("")
    monkeypatch.setattr(lustre, "LFS_TIMEOUT_S", 0.5)
    (found,) = lustre.check_lustre(store, mount, 5 * GB)
    assert found.status == "skip" and "did not answer" in found.detail

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (found,) = lustre.check_lustre(store, mount, 5 * GB)
    assert found.status == "skip" and "lfs is not on PATH" in found.detail
    # Not on Lustre: no striping check at all, whatever lfs says.
    assert lustre.check_lustre(store, Mount("/", "ext4", "/dev/sda1"), 5 * GB) == []


# -- NFS -----------------------------------------------------------------------------

NFS_DEFAULTS = "rw,vers=4.2,rsize=1048576,wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,sec=sys,local_lock=none"


def test_nfs_defaults_warn_about_the_export_clear_text_and_stale_listings(tmp_path, store):
    host = Host(
        _mountinfo(tmp_path / "mi", (str(tmp_path / "mnt"), "nfs4", "fs:/export", NFS_DEFAULTS))
    )
    found = _found(diagnose(open_store(store), Places(), host=host))
    writes = found["NFS writes"]
    assert writes["status"] == "warn" and "mounted async" in writes["detail"]
    assert "COMMIT" in writes["detail"] and "exports the filesystem sync" in writes["detail"]
    assert "exportfs -v" in writes["fix"]
    security = found["NFS security"]
    assert security["status"] == "warn" and "sec=sys" in security["detail"]
    assert "clear text" in security["detail"] and "sec=krb5p" in security["fix"]
    assert "keystore=" in security["fix"]
    caching = found["NFS attribute caching"]
    assert caching["status"] == "warn" and "up to 60 s" in caching["detail"]
    assert found["store filesystem"]["status"] == "warn"  # fsync and rename need the server


def test_nfs_sync_krb5p_noac_pass_and_encryption_answers_clear_text(tmp_path):
    root = tmp_path / "a b" / "store"
    # /proc/mounts' format too, with the kernel's escape for a space.
    table = tmp_path / "mounts"
    table.write_text(
        "/dev/sda1 / ext4 rw 0 0\n"
        f"fs:/export {tmp_path}/a\\040b nfs rw,sync,vers=3,sec=krb5p,noac 0 0\n"
        f"/dev/sdb1 {tmp_path}/a\\040b/scratch ext4 rw 0 0\n"
    )
    mount = mount_of(root, table)
    assert mount is not None and mount.point == f"{tmp_path}/a b" and mount.fstype == "nfs"
    assert [f.status for f in check_nfs(root, mount, encrypted=False)] == ["ok", "ok", "ok"]
    assert mount_of(tmp_path / "a b" / "scratch" / "x", table).fstype == "ext4"  # longest wins

    plain = Mount(mount.point, "nfs4", "fs:/e", {"sec": "krb5i", "actimeo": "5"})
    found = _found(check_nfs(root, plain, encrypted=False))
    assert (
        found["NFS security"]["status"] == "warn"
        and "not encrypted" in found["NFS security"]["detail"]
    )
    assert "up to 5 s" in found["NFS attribute caching"]["detail"]
    found = _found(check_nfs(root, plain, encrypted=True))
    assert (
        found["NFS security"]["status"] == "ok" and "ciphertext" in found["NFS security"]["detail"]
    )
    assert check_nfs(root, Mount("/", "ext4", "/dev/sda1"), encrypted=False) == []


# -- host memory ---------------------------------------------------------------------


def test_doctor_says_whether_async_staging_fits_in_memory(tmp_path, store, monkeypatch, capsys):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n")  # 4 GiB
    monkeypatch.setattr(memory_available, "MEMINFO", meminfo)
    monkeypatch.setattr(memory_available, "SELF_CGROUP", tmp_path / "none")
    check = "host memory for async saves"
    host = Host(tmp_path / "no-mountinfo")

    plan = RunPlan(state_bytes=3 * 2**30, max_in_flight=2)
    found = _found(diagnose(open_store(store), Places(), plan, host))[check]
    assert found["status"] == "warn" and "does not fit" in found["detail"]
    assert "6.0 GiB" in found["detail"] and "4.0 GiB available" in found["detail"]
    assert "HostMemoryError" in found["detail"] and "max_in_flight" in found["fix"]

    found = _found(diagnose(open_store(store), Places(), RunPlan(state_bytes=2**30), host))[check]
    assert found["status"] == "ok" and "1.0 GiB" in found["detail"]

    main(["doctor", str(store), "--json", "--state-size", "3GiB", "--max-in-flight", "2"])
    listed = {f["check"]: f for f in json.loads(capsys.readouterr().out)}
    assert listed[check]["status"] == "warn" and "6.0 GiB" in listed[check]["detail"]
    assert main(["doctor", str(store), "--state-size", "lots"]) == 2
    assert "--state-size 'lots' is not a size" in capsys.readouterr().err

    _grow(store, 2**30 + 2**29)  # no size given: the largest generation's
    found = _found(diagnose(open_store(store), Places(), RunPlan(max_in_flight=3), host))[check]
    assert found["status"] == "warn" and "largest generation here, step 1" in found["detail"]


# -- S3 lifecycle rules --------------------------------------------------------------


def _rules(endpoint: str, bucket: str, *rules: dict) -> None:
    s3_client(endpoint).put_bucket_lifecycle_configuration(
        Bucket=bucket, LifecycleConfiguration={"Rules": list(rules)}
    )


def _expire(rule_id: str, days: int, selector: dict) -> dict:
    return {"ID": rule_id, "Status": "Enabled", "Filter": selector, "Expiration": {"Days": days}}


ABORT = {
    "ID": "abort",
    "Status": "Enabled",
    "Filter": {"Prefix": ""},
    "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 3},
}


def test_s3_lifecycle_rules_that_expire_kept_generations_or_keep_parts(
    s3_endpoint, tmp_path, capsys
):
    bucket = new_bucket(s3_endpoint)
    url = f"s3://{bucket}/run"
    with cv.CheckpointManager(url, run_id="r", ledger=tmp_path / "ledger") as mgr:
        mgr.save(1, {"x": torch.ones(3)})
    month = RunPlan(retention_days=30)

    def doctor() -> dict[str, dict]:
        found = _found(diagnose(open_store(url), Places(), month))
        return {k: v for k, v in found.items() if k.startswith("bucket lifecycle")}

    found = doctor()  # no lifecycle configuration at all
    assert found["bucket lifecycle expiration"]["status"] == "ok"
    abort = found["bucket lifecycle aborts uploads"]
    assert abort["status"] == "warn" and "and bills" in abort["detail"]
    assert f"put-bucket-lifecycle-configuration --bucket {bucket}" in abort["fix"]
    assert '"AbortIncompleteMultipartUpload"' in abort["fix"] and '"run/"' in abort["fix"]

    _rules(s3_endpoint, bucket, _expire("tmp", 7, {"Prefix": "run/"}), ABORT)
    found = doctor()
    expiry = found["bucket lifecycle expiration"]
    assert expiry["status"] == "fail" and "'tmp'" in expiry["detail"]
    assert "7 days" in expiry["detail"] and "30 days" in expiry["detail"]
    assert "ckptvault gc" in expiry["fix"]
    assert found["bucket lifecycle aborts uploads"]["status"] == "ok"
    assert "3 days" in found["bucket lifecycle aborts uploads"]["detail"]
    # From the command line: the horizon stated, or else the age of the oldest
    # generation in the store (minutes here: the 7-day rule is then only a warning).
    for extra, status in ((["--retention-days", "30"], "fail"), ([], "warn")):
        main(["doctor", url, "--ledger", str(tmp_path / "ledger"), "--json", *extra])
        listed = {f["check"]: f for f in json.loads(capsys.readouterr().out)}
        assert listed["bucket lifecycle expiration"]["status"] == status

    # Longer than retention, still over the newest generation: a warning.
    _rules(s3_endpoint, bucket, _expire("year", 365, {}), ABORT)
    expiry = doctor()["bucket lifecycle expiration"]
    assert expiry["status"] == "warn" and "the whole bucket" in expiry["detail"]
    assert "loses every checkpoint" in expiry["detail"]

    # Rules elsewhere, by tag, or disabled do not touch the store.
    disabled = {**_expire("off", 1, {"Prefix": "run/"}), "Status": "Disabled"}
    tagged = _expire("tagged", 1, {"Tag": {"Key": "tier", "Value": "scratch"}})
    _rules(s3_endpoint, bucket, _expire("logs", 1, {"Prefix": "logs/"}), tagged, disabled)
    found = doctor()
    assert found["bucket lifecycle expiration"]["status"] == "ok"
    assert found["bucket lifecycle aborts uploads"]["status"] == "warn"

    # The policy the manager records in the store counts: milestones are kept at any
    # age, so even a year's expiry deletes generations retention keeps.
    _rules(s3_endpoint, bucket, _expire("year", 365, {"Prefix": "run/"}), ABORT)
    keep = cv.Retention(keep_last=2, keep_every=1000)
    with cv.CheckpointManager(url, run_id="r", ledger=tmp_path / "ledger", retention=keep) as mgr:
        mgr.save(2, {"x": torch.ones(3)})
    expiry = _found(diagnose(open_store(url), Places()))["bucket lifecycle expiration"]
    assert expiry["status"] == "fail" and "unbounded" in expiry["detail"]
    assert "keep_every=1000" in expiry["detail"]


def test_s3_lifecycle_transitions_to_an_archive_class(s3_endpoint, tmp_path):
    """Glacier and Deep Archive objects need a RestoreObject before a GET reads them:
    a rule moving the store there inside the retention horizon fails, later warns;
    an instantly readable class is fine."""
    bucket = new_bucket(s3_endpoint)
    url = f"s3://{bucket}/run"
    with cv.CheckpointManager(url, run_id="r", ledger=tmp_path / "ledger") as mgr:
        mgr.save(1, {"x": torch.ones(3)})

    def moved(storage_class: str, days: int) -> dict:
        rule = {"ID": "cold", "Status": "Enabled", "Filter": {"Prefix": "run/"},
                "Transitions": [{"Days": days, "StorageClass": storage_class}]}  # fmt: skip
        _rules(s3_endpoint, bucket, rule, ABORT)
        found = _found(diagnose(open_store(url), Places(), RunPlan(retention_days=30)))
        return found["bucket lifecycle transitions"]

    assert moved("GLACIER_IR", 1)["status"] == "ok"
    inside = moved("DEEP_ARCHIVE", 7)
    assert inside["status"] == "fail" and "DEEP_ARCHIVE 7 days" in inside["detail"]
    assert "GLACIER_IR" in inside["fix"]
    assert moved("GLACIER", 90)["status"] == "warn"


def test_how_far_back_a_retention_policy_keeps_generations():
    assert policy_horizon(cv.Retention(keep_daily=30, keep_hourly=48)).days == 30
    assert policy_horizon(cv.Retention(keep_weekly=8, keep_within=86400)).days == 56
    assert policy_horizon(cv.Retention(keep_last=3)).days == 0  # young while the run saves
    best = cv.Retention(keep_last=1, keep_best=2, metric="val_loss")
    assert policy_horizon(best).days == float("inf")
