"""Hostile inputs to issue 28's run-time operations: the retention policy recorded in
the store, the doctor's suggested commands, save policies' numbers, progress files.

Each test is an attack that once worked: whoever can write the store (or the bucket,
or the job's progress directory) tried to make ckptvault delete, run or hang.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ckptvault as cv
from ckptvault.retention.recorded import RETENTION_RECORD, record_name
from ckptvault.storage import open_store
from ckptvault.trust.signing import generate_keypair
from support.common import run_cli

FORGED_KEEP_ONE = {"keep_last": 1, "delete_delay": 0}


def _steps(store: Path) -> list[int]:
    listed = run_cli("ls", str(store), "--all", "--json")
    return [g["step"] for g in json.loads(listed.stdout)]


def _forge_record(store: Path, policy: dict) -> None:
    document = {"version": 1, "run_id": "r", "policy": policy, "recorded_at": "x"}
    open_store(store).put_record(RETENTION_RECORD, record_name("r"), document)


def test_a_forged_record_does_not_make_a_bare_gc_delete_signed_generations(tmp_path: Path):
    """A signed store, gc given the trusted key and the ledger: it accepts only signed
    generations and ledger-recorded marks, so an unsigned record planted in the store
    must not decide alone what is marked and deleted (DESIGN rule 7). It once did:
    `gc STORE --trusted-key K` applied a planted keep_last=1 and deleted steps 1-4."""
    generate_keypair(tmp_path / "k", tmp_path / "k.pub")
    store, ledger = tmp_path / "store", tmp_path / "ledger"
    genuine = cv.Retention(keep_last=6, delete_delay=0)
    with cv.CheckpointManager(
        store, run_id="r", signing_key=tmp_path / "k", ledger=ledger, retention=genuine,
        catalog=False,
    ) as mgr:  # fmt: skip
        for step in range(1, 7):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    _forge_record(store, FORGED_KEEP_ONE)
    trust = ["--trusted-key", str(tmp_path / "k.pub"), "--ledger", str(ledger)]
    result = run_cli("gc", str(store), *trust)
    assert result.returncode == 0, result.stderr
    assert _steps(store) == [6, 5, 4, 3, 2, 1]
    assert "not applied alone" in result.stderr
    # With rules given the record still only adds keeps (the union), as before.
    result = run_cli("gc", str(store), *trust, "--keep-last", "4", "--delete-delay", "0s")
    assert result.returncode == 0, result.stderr
    assert _steps(store) == [6, 5, 4, 3]


def test_the_doctors_lifecycle_command_quotes_the_store_prefix():
    """An S3 key prefix may hold any character. The doctor's suggested command once
    put it inside '...' unescaped: a prefix with a quote broke out, and pasting the
    command ran what followed (here ``$(touch ...)``)."""
    import shlex

    from ckptvault.ops.doctor.lifecycle import Horizon, check_lifecycle

    class NoRules:
        bucket = "b"

        def call(self, operation: str) -> dict:
            return {"Rules": []}

    prefix = "run'$(touch /tmp/pwned)'; x/"
    findings = check_lifecycle(NoRules(), prefix, Horizon())
    [abort] = [f for f in findings if f.check == "bucket lifecycle aborts uploads"]
    assert abort.fix is not None
    command = abort.fix[abort.fix.index("aws s3api") : abort.fix.index(" (7 days")]
    words = shlex.split(command)
    assert words[:3] == ["aws", "s3api", "put-bucket-lifecycle-configuration"]
    assert words[words.index("--bucket") + 1] == "b"
    configuration = json.loads(words[words.index("--lifecycle-configuration") + 1])
    assert configuration["Rules"][0]["Filter"]["Prefix"] == prefix
    assert len(words) == 7  # nothing spilled out of the quoted argument


def test_lfs_output_with_an_endless_or_foreign_stripe_count_is_not_understood():
    """The doctor promises that lfs output it cannot read is a skipped check, never a
    raise: a stripe count of 5,000 digits once raised int()'s ValueError (a traceback),
    and Arabic-Indic digits were read as a count."""
    from ckptvault.ops.doctor.lustre import parse_stripe_count

    assert parse_stripe_count("stripe_count:  " + "1" * 5000) is None
    assert parse_stripe_count("stripe_count:  \u0664") is None
    assert parse_stripe_count("  lmm_stripe_count:  4\n") == 4


def test_an_nfs_option_value_of_odd_digits_falls_back_to_the_default():
    """str.isdigit() accepts '²' and runs of thousands of digits, which int() then
    refuses with ValueError: a mount table with odd characters crashed the doctor."""
    from ckptvault.ops.doctor.mounts import Mount
    from ckptvault.ops.doctor.nfs import NFS_DEFAULT_ACDIRMAX, attribute_cache_seconds

    for odd in ("\u00b2", "9" * 5000):
        mount = Mount("/mnt/ckpt", "nfs4", "server:/export", {"acdirmax": odd})
        assert attribute_cache_seconds(mount) == NFS_DEFAULT_ACDIRMAX
    assert attribute_cache_seconds(Mount("/m", "nfs4", "s:/e", {"actimeo": "30"})) == 30


def test_a_planned_policy_whose_job_mtbf_is_no_number_is_refused_on_every_rank():
    """cv.Planned(mtbf_hours=1e306) passed its checks, but mtbf x 3600 / nodes is
    infinite (and 1e-320 h over 10^9 nodes is 0): Daly's interval then raised when the
    schedule was made, which with several ranks happens on rank 0 alone, so rank 0's
    manager failed while the others went on to wait for its broadcast. The policy is
    refused where it is made: the same UsageError on every rank."""
    import pytest

    from ckptvault.errors import UsageError

    for arguments in ({"mtbf_hours": 1e306}, {"mtbf_hours": 1e-320, "nodes": 10**9}):
        with pytest.raises(UsageError, match="MTBF"):
            cv.Planned(**arguments)
    assert cv.Planned(mtbf_hours=50_000, nodes=64).schedule(0.0).due(1, 0.0) is False


def test_a_peers_step_time_no_float_holds_is_refused_on_rank_0_not_raised(caplog):
    """A rank sends ``{"step_s": 10**400}`` in the step-time exchange: bounded JSON
    allows 400 digits, and ``math.isfinite`` then raised OverflowError on rank 0 alone,
    an untyped error out of its heartbeat while the other ranks went on. It is a
    refused message: logged on rank 0, the last figures kept, every rank carries on."""
    from ckptvault.observe.stragglers import exchange_step_times

    class Rank0:
        rank, world_size, is_coordinator = 0, 2, True

        def gather(self, value: object) -> list:
            return [value, {"step_s": 10**400}]

    assert exchange_step_times(Rank0(), 1.0) is None  # type: ignore[arg-type]
    assert "out of range" in caplog.text or "not a number" in caplog.text


def test_a_step_time_no_float_holds_is_a_usage_error(tmp_path: Path):
    """heartbeat(step, step_seconds=10**400) raised OverflowError, not the UsageError
    that every other bad step time gets."""
    import pytest

    from ckptvault.errors import UsageError

    store = tmp_path / "store"
    with (
        cv.CheckpointManager(store, run_id="r", catalog=False) as mgr,
        pytest.raises(UsageError, match="step_seconds"),
    ):
        mgr.heartbeat(1, step_seconds=10**400)


def test_a_policy_number_no_float_holds_is_a_usage_error():
    """cv.Every(seconds=10**400) raised OverflowError (math.isfinite of the int), not
    the UsageError every other bad number gets."""
    import pytest

    from ckptvault.errors import UsageError

    with pytest.raises(UsageError, match="seconds"):
        cv.Every(seconds=10**400)
    with pytest.raises(UsageError, match="mtbf_hours"):
        cv.Planned(mtbf_hours=10**400)
