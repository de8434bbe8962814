"""Prometheus metrics of a manager: names, values after real saves, restores and
failures, the HTTP endpoint, one registry per manager, the replica tier."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ckptvault as cv
from ckptvault.errors import KeyUnavailableError, UsageError
from support.common import REPO
from support.keystores import ControlledKeyStore as GatedKeyStore

REQUIRED = {
    "ckptvault_last_good_checkpoint_age_seconds",
    "ckptvault_save_blocking_seconds",
    "ckptvault_save_duration_seconds",
    "ckptvault_save_bytes",
    "ckptvault_save_failures",
    "ckptvault_saves",
    "ckptvault_restores",
    "ckptvault_restore_duration_seconds",
    "ckptvault_storage_used_bytes",
}


def scrape(mgr: cv.CheckpointManager) -> dict[str, dict[tuple, float]]:
    """Every sample by name, then by its sorted labels."""
    text = generate_latest(mgr.metrics_registry).decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def test_names_follow_prometheus_conventions(store: Path, tmp_path: Path):
    with cv.CheckpointManager(store, run_id="r", replicate_to=tmp_path / "replica") as mgr:
        mgr.save(1, {"w": torch.ones(8)})
        mgr.save(2, {"w": torch.ones(8)})
        mgr.replicator.wait()  # type: ignore[union-attr]
        mgr.restore({"w": torch.zeros(8)})
        families = list(
            text_string_to_metric_families(generate_latest(mgr.metrics_registry).decode())
        )
    names = {f.name for f in families}
    assert REQUIRED | {"ckptvault_replication_lag_seconds"} <= names
    for family in families:
        assert family.name.startswith("ckptvault_"), family.name
        for sample in family.samples:
            assert set(sample.labels) <= {"run_id", "tier", "rank", "le"}, sample
            assert sample.labels["run_id"] == "r"
        if family.name.endswith("_created"):  # a counter's creation time, a Unix time
            continue
        words = family.name.split("_")
        if family.type == "counter":
            assert {s.name[len(family.name) :] for s in family.samples} <= {"_total", "_created"}
        if family.type == "histogram" or {"age", "lag", "duration"} & set(words):
            assert family.name.endswith("_seconds"), family.name
        if "bytes" in words:
            assert family.name.endswith("_bytes"), family.name
        assert not family.name.endswith("_total"), "counters are declared without _total"


def test_values_move_with_saves_restores_and_failures(store: Path, tmp_path: Path):
    keys = GatedKeyStore(tmp_path / "keys")
    with cv.CheckpointManager(store, run_id="r", keystore=keys, async_save=True) as mgr:
        before = scrape(mgr)
        assert value(before, "ckptvault_saves_total", run_id="r") == 0
        mgr.save(1, {"w": torch.ones(1000)}).result()
        mgr.save(2, {"w": torch.ones(1000)}).result()
        keys.fail = True
        with pytest.raises(KeyUnavailableError):
            mgr.save(3, {"w": torch.ones(1000)}).result()
        keys.fail = False
        mgr.restore({"w": torch.zeros(1000)})
        after = scrape(mgr)
        time.sleep(0.3)
        later = scrape(mgr)
        listed = sum(g.bytes for g in mgr.generations())
    assert value(after, "ckptvault_saves_total", run_id="r") == 2
    assert value(after, "ckptvault_save_failures_total", run_id="r") == 1
    assert value(after, "ckptvault_save_bytes_total", run_id="r") >= 2 * 4000
    assert value(after, "ckptvault_save_duration_seconds_count", run_id="r") == 2
    assert value(after, "ckptvault_save_blocking_seconds_count", run_id="r") == 2
    total = value(after, "ckptvault_save_duration_seconds_sum", run_id="r")
    assert 0 < value(after, "ckptvault_save_blocking_seconds_sum", run_id="r") <= total
    assert value(after, "ckptvault_restores_total", run_id="r") == 1
    assert value(after, "ckptvault_restore_duration_seconds_count", run_id="r") == 1
    assert value(after, "ckptvault_storage_used_bytes", run_id="r", tier="local") == listed
    assert value(after, "ckptvault_generations", run_id="r", tier="local") == 2
    assert 0 < value(after, "ckptvault_storage_filesystem_used_ratio", run_id="r", tier="local") < 1
    # The age is computed at each scrape: it grows while nothing is published.
    age = value(after, "ckptvault_last_good_checkpoint_age_seconds", run_id="r")
    assert value(later, "ckptvault_last_good_checkpoint_age_seconds", run_id="r") >= age + 0.25


def test_a_restarted_job_reports_the_age_of_the_checkpoint_already_there(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    time.sleep(1.0)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        age = value(scrape(mgr), "ckptvault_last_good_checkpoint_age_seconds", run_id="r")
    assert age >= 1.0


def test_the_http_endpoint_serves_the_managers_metrics(store: Path):
    with cv.CheckpointManager(store, run_id="r", metrics_port=0, metrics_addr="127.0.0.1") as mgr:
        assert mgr.metrics is not None and mgr.metrics.port
        url = f"http://127.0.0.1:{mgr.metrics.port}/metrics"
        mgr.save(1, {"w": torch.ones(2)})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
    assert 'ckptvault_saves_total{run_id="r"} 1.0' in body
    assert 'ckptvault_last_good_checkpoint_age_seconds{run_id="r"}' in body
    with pytest.raises(urllib.error.URLError):  # close() stops serving
        urllib.request.urlopen(url, timeout=5)


def test_a_taken_port_is_a_usage_error(store: Path, tmp_path: Path):
    with cv.CheckpointManager(store, run_id="a", metrics_port=0) as first:
        port = first.metrics.port  # type: ignore[union-attr]
        with pytest.raises(UsageError, match=f"metrics_port={port}"):
            cv.CheckpointManager(tmp_path / "other", run_id="b", metrics_port=port)


def test_two_managers_in_one_process_keep_their_own_metrics(tmp_path: Path):
    with (
        cv.CheckpointManager(tmp_path / "a", run_id="a", metrics_port=0) as a,
        cv.CheckpointManager(tmp_path / "b", run_id="b", metrics_port=0) as b,
    ):
        a.save(1, {"w": torch.ones(2)})
        a.save(2, {"w": torch.ones(2)})
        b.save(1, {"w": torch.ones(2)})
        assert a.metrics_registry is not b.metrics_registry
        from_a, from_b = scrape(a), scrape(b)
    assert from_a["ckptvault_saves_total"] == {(("run_id", "a"),): 2.0}
    assert from_b["ckptvault_saves_total"] == {(("run_id", "b"),): 1.0}
    from prometheus_client import REGISTRY

    assert not any(name.startswith("ckptvault_") for name in REGISTRY._names_to_collectors)


def test_metrics_off(store: Path):
    with cv.CheckpointManager(store, run_id="r", metrics=False) as mgr:
        assert mgr.metrics is None and mgr.metrics_registry is None
    with pytest.raises(UsageError, match="metrics_port"):
        cv.CheckpointManager(store, run_id="r", metrics=False, metrics_port=9)
    with pytest.raises(UsageError, match="metrics_addr"):
        cv.CheckpointManager(store, run_id="r", metrics_addr="0.0.0.0")


def test_without_prometheus_client_asking_for_metrics_says_how_to_install(store: Path):
    script = (
        "import sys; sys.modules['prometheus_client'] = None\n"  # as if not installed
        "import ckptvault as cv\n"
        f"with cv.CheckpointManager({str(store)!r}, run_id='r') as mgr:\n"
        "    assert mgr.metrics_registry is None\n"  # not asked for: quietly off
        "try:\n"
        f"    cv.CheckpointManager({str(store)!r}, run_id='r', metrics_port=0)\n"
        "except cv.errors.UsageError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'ckptvault[metrics]'" in result.stdout


def test_replication_lag_and_the_replica_tier(store: Path, tmp_path: Path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the replica's parent should be")
    with cv.CheckpointManager(store, run_id="r", replicate_to=blocker / "replica") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        mgr.replicator.wait()  # type: ignore[union-attr]  # failed: tried again later
        time.sleep(0.5)
        behind = scrape(mgr)
    assert value(behind, "ckptvault_replication_lag_seconds", run_id="r") >= 0.5
    replica = tmp_path / "replica"
    with cv.CheckpointManager(store, run_id="r", replicate_to=replica) as mgr:
        mgr.save(2, {"w": torch.ones(2)})  # also copies what the last process left behind
        mgr.replicator.wait()  # type: ignore[union-attr]
        caught_up = scrape(mgr)
    assert value(caught_up, "ckptvault_replication_lag_seconds", run_id="r") == 0
    assert value(caught_up, "ckptvault_replications_total", run_id="r") == 2
    local = value(caught_up, "ckptvault_storage_used_bytes", run_id="r", tier="local")
    assert value(caught_up, "ckptvault_storage_used_bytes", run_id="r", tier="replica") == local


def test_validations_are_counted_and_age(store: Path):
    def build():
        model = torch.nn.Linear(4, 2)
        return {"model": model}, lambda state: bool(
            torch.isfinite(state["model"](torch.ones(1, 4))).all()
        )

    with cv.CheckpointManager(store, run_id="r", catalog=False) as mgr:
        assert "ckptvault_last_validated_checkpoint_age_seconds" not in scrape(mgr)
        mgr.save(1, {"model": torch.nn.Linear(4, 2)})
        assert mgr.validate(build).ok
        samples = scrape(mgr)
    assert value(samples, "ckptvault_validations_total", run_id="r") == 1
    assert value(samples, "ckptvault_validation_failures_total", run_id="r") == 0
    assert 0 <= value(samples, "ckptvault_last_validated_checkpoint_age_seconds", run_id="r") < 60
