"""``ckptvault status``: health from the store's listing and the catalog, a warning
at every alert threshold (exit status 1), and the shipped alert rules and dashboard.

Situations are made for real where a test can make them (failed saves through a
key store that fails, a slow save held up by it, a nearly full tmpfs, a replica that
cannot be written); what would take hours (a 60 s median, a 4 h lag) is written into
the catalog through its API with the times it would have had.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ckptvault as cv
from ckptvault.events import Published
from ckptvault.observe.catalog import Catalog, store_key
from support.common import REPO, mounted_tmpfs, run_cli
from support.doc_pages import anchors
from support.keystores import ControlledKeyStore as GatedKeyStore

# Where each alert rule's runbook_url points: the Runbook of the operations guide.
RUNBOOK_PAGE = "docs/guides/operations.md"


@pytest.fixture
def catalog_path(isolated_state_dir: Path) -> Path:
    return isolated_state_dir / "catalog.sqlite3"


def status(store: Path, *args: str) -> tuple[int, dict]:
    result = run_cli("status", str(store), "--json", *args)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def alerts(report: dict) -> set[str]:
    return {w["alert"] for w in report["warnings"]}


def save_some(store: Path, steps: range, **options) -> int:
    """Save ``steps``; returns the bytes the store's generations hold."""
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        for step in steps:
            mgr.save(step, {"w": torch.ones(64)})
        return sum(g.bytes for g in mgr.generations())


def test_status_after_real_saves_is_healthy(store: Path, catalog_path: Path):
    held = save_some(store, range(1, 4))
    code, report = status(store, "--cadence-seconds", "3600")
    assert code == 0 and report["healthy"] and report["warnings"] == []
    assert 0 <= report["last_good_age_s"] < 60
    assert report["last_good_step"] == 3 and report["generations"] == 3
    assert report["last_validated_age_s"] is None
    assert report["saves"] == {
        "recent": 3,
        "failed": 0,
        "success_rate": 1.0,
        "failure_rate": 0.0,
        "last_failed": False,
    }
    assert 0 < report["save_total_s"]["p50"] <= report["save_total_s"]["p99"]
    assert report["storage"]["tiers"] == {str(store.resolve()): held}
    assert 0 < report["storage"]["filesystem"]["used_fraction"] < 1
    assert report["replication_lag_s"] is None  # never replicated
    assert report["catalog"] == str(catalog_path)


def test_text_and_prometheus_forms(store: Path):
    save_some(store, range(1, 3))
    text = run_cli("status", str(store), "--cadence-seconds", "3600")
    assert text.returncode == 0, text.stderr
    assert "healthy" in text.stdout and "last good" in text.stdout
    exposed = run_cli("status", str(store), "--prometheus", "--cadence-seconds", "3600")
    assert exposed.returncode == 0, exposed.stderr
    families = {f.name: f for f in text_string_to_metric_families(exposed.stdout)}
    (age,) = families["ckptvault_last_good_checkpoint_age_seconds"].samples
    assert 0 <= age.value < 60 and age.labels == {"run_id": "r"}
    assert all(name.startswith("ckptvault_") for name in families)
    both = run_cli("status", str(store), "--json", "--prometheus")
    assert both.returncode == 2 and "not both" in both.stderr
    missing = run_cli("status", str(store), "--catalog", str(store.parent / "none.sqlite3"))
    assert missing.returncode == 2 and "no catalog at" in missing.stderr


def test_an_old_checkpoint_is_stale(store: Path):
    save_some(store, range(1, 2))
    time.sleep(1.1)
    code, report = status(store, "--cadence-seconds", "0.5")
    assert code == 1 and alerts(report) == {"CkptvaultCheckpointStale"}
    assert report["cadence_s"] == 0.5 and report["cadence_source"] == "given"


def test_the_cadence_is_the_median_interval_between_saves(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        for step in range(4):
            mgr.save(step, {"w": torch.ones(4)})
            time.sleep(0.3)
    time.sleep(0.5)  # older than 2 x 0.3 s now
    code, report = status(store)
    assert report["cadence_source"] == "saves" and 0.25 < report["cadence_s"] < 1.0
    assert code == 1 and "CkptvaultCheckpointStale" in alerts(report)


def test_an_empty_store_has_no_checkpoint(store: Path):
    store.mkdir()
    code, report = status(store)
    assert code == 1 and report["last_good_age_s"] is None
    assert alerts(report) == {"CkptvaultCheckpointStale"}


def test_failed_saves_lower_the_success_rate_and_put_the_last_generation_at_risk(
    store: Path, tmp_path: Path
):
    keys = GatedKeyStore(tmp_path / "keys")
    with cv.CheckpointManager(store, run_id="r", keystore=keys, async_save=True) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).result()
        keys.fail = True
        with pytest.raises(cv.errors.KeyUnavailableError):
            mgr.save(2, {"w": torch.ones(4)}).result()
        keys.fail = False
    code, report = status(store, "--cadence-seconds", "3600")
    assert code == 1
    assert alerts(report) == {"CkptvaultSaveFailures", "CkptvaultLastCheckpointAtRisk"}
    assert report["saves"]["success_rate"] == 0.5 and report["saves"]["last_failed"]
    # A good save afterwards: the last write is fine again, the rate still low.
    with cv.CheckpointManager(store, run_id="r", keystore=keys) as mgr:
        mgr.save(3, {"w": torch.ones(4)})
    code, report = status(store, "--cadence-seconds", "3600")
    assert code == 1 and alerts(report) == {"CkptvaultSaveFailures"}


def test_a_slow_tail_is_flagged(store: Path, tmp_path: Path):
    keys = GatedKeyStore(tmp_path / "keys")
    with cv.CheckpointManager(store, run_id="r", keystore=keys, async_save=True) as mgr:
        for step in range(5):
            mgr.save(step, {"w": torch.ones(4)}).result()
        keys.gate.clear()  # the key service stalls this one save
        handle = mgr.save(5, {"w": torch.ones(4)})
        time.sleep(1.5)
        keys.gate.set()
        handle.result()
    code, report = status(store, "--cadence-seconds", "3600")
    assert code == 1 and alerts(report) == {"CkptvaultSaveTail"}
    latency = report["save_total_s"]
    assert latency["p99"] >= 1.5 > 3 * latency["p50"]


def test_a_slow_median_is_flagged(store: Path, catalog_path: Path):
    save_some(store, range(1, 2))
    generation = cv.CheckpointManager(store, run_id="r").generations()[0]
    now = time.time()
    with Catalog(catalog_path) as book:  # three saves of 90 s each, in the last hours
        for hours_ago in (3, 2, 1):
            slow = Published(
                "r", store_key(store), generation.step, generation.generation_id,
                generation.path, generation.bytes, 90.0, stall_seconds=90.0, total_seconds=90.0,
            )  # fmt: skip
            book.record(slow, when=now - hours_ago * 3600)
    code, report = status(store, "--cadence-seconds", "3600")
    assert report["save_total_s"]["p50"] == 90.0
    assert code == 1 and alerts(report) == {"CkptvaultSaveSlow"}


def test_a_nearly_full_filesystem_is_flagged(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "small", "size=4m") as mount_point:
        store = mount_point / "store"
        save_some(store, range(1, 2))
        (mount_point / "ballast").write_bytes(b"\0" * (int(3.6 * 2**20)))
        code, report = status(store, "--cadence-seconds", "3600")
    assert report["storage"]["filesystem"]["used_fraction"] > 0.85
    assert code == 1 and alerts(report) == {"CkptvaultStorageFilling"}


def test_replication_lag(store: Path, tmp_path: Path, catalog_path: Path):
    replica = tmp_path / "replica"
    with cv.CheckpointManager(store, run_id="r", replicate_to=replica) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
        mgr.replicator.wait()  # type: ignore[union-attr]
    code, report = status(store, "--cadence-seconds", "3600")
    assert code == 0 and report["replication_lag_s"] == 0 and report["replication_healthy"]
    assert set(report["storage"]["tiers"]) == {str(store.resolve()), str(replica.resolve())}
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("the replica cannot be written")
    with cv.CheckpointManager(store, run_id="r", replicate_to=blocker / "replica") as mgr:
        mgr.save(2, {"w": torch.ones(4)})  # its copy fails
    newest = cv.CheckpointManager(store, run_id="r").generations()[0]
    code, report = status(store, "--cadence-seconds", "3600")
    assert code == 0 and 0 < report["replication_lag_s"] < 3600  # behind, still healthy
    with Catalog(catalog_path) as book:  # as if step 2 had been published 5 h ago
        published = Published(
            "r", store_key(store), newest.step, newest.generation_id, newest.path,
            newest.bytes, 0.1, total_seconds=0.1,
        )  # fmt: skip
        book.record(published, when=time.time() - 5 * 3600)
    code, report = status(store, "--cadence-seconds", "86400")
    assert 5 * 3600 <= report["replication_lag_s"] < 5 * 3600 + 600
    assert code == 1 and alerts(report) == {"CkptvaultReplicationLagging"}
    assert not report["replication_healthy"]


def test_the_age_of_the_newest_validation(store: Path, catalog_path: Path):
    save_some(store, range(1, 3))
    generation = cv.CheckpointManager(store, run_id="r").generations()[-1]
    with Catalog(catalog_path) as book:
        assert book.mark_validated(generation.generation_id, time.time() - 100)
    code, report = status(store, "--cadence-seconds", "3600")
    assert code == 0 and 100 <= report["last_validated_age_s"] < 160


# -- contrib/: the alert rules and the dashboard name metrics that exist -------------


def exposed_names(tmp_path: Path) -> set[str]:
    """Every sample name a manager exposes (with a replica and a validation)."""
    catalog = tmp_path / "names.sqlite3"
    options = {"run_id": "r", "catalog": catalog, "replicate_to": tmp_path / "names-replica"}
    with cv.CheckpointManager(tmp_path / "names", **options) as mgr:  # type: ignore[arg-type]
        mgr.save(1, {"w": torch.ones(2)})
        mgr.save(2, {"w": torch.ones(2)})
        mgr.replicator.wait()  # type: ignore[union-attr]
        mgr.restore({"w": torch.ones(2)})
        with Catalog(catalog) as book:
            book.mark_validated(mgr.generations()[0].generation_id, time.time())
        text = generate_latest(mgr.metrics_registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def metric_names_in(text: str) -> set[str]:
    return set(re.findall(r"\bckptvault_[a-z_]+[a-z]", text))


def test_alert_rules_name_existing_metrics_and_runbook_entries(tmp_path: Path):
    rules = yaml.safe_load((REPO / "contrib" / "alerts.yml").read_text())
    (group,) = rules["groups"]
    names = exposed_names(tmp_path)
    seen = set()
    for rule in group["rules"]:
        used = metric_names_in(rule["expr"])
        assert used and used <= names, (rule["alert"], used - names)
        # The runbook entry is a heading of the operations page, under the anchor the
        # site (mkdocs' toc) and GitHub both give it.
        url = rule["annotations"]["runbook_url"]
        page, anchor = url.split("#", 1)
        assert page == RUNBOOK_PAGE, url
        assert anchor == rule["alert"].lower() in anchors(REPO / page), url
        seen.add(rule["alert"])
    # Every status warning has its rule and runbook entry, and the other way round;
    # besides them, the run-time rule on stragglers (ckptvault_straggler).
    assert seen - {"CkptvaultStraggler"} == {
        "CkptvaultCheckpointStale",
        "CkptvaultSaveSlow",
        "CkptvaultSaveTail",
        "CkptvaultSaveFailures",
        "CkptvaultStorageFilling",
        "CkptvaultReplicationLagging",
        "CkptvaultLastCheckpointAtRisk",
    }


def test_the_dashboard_references_existing_metrics_only(tmp_path: Path):
    text = (REPO / "contrib" / "grafana-dashboard.json").read_text()
    dashboard = json.loads(text)
    assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"])
    used = metric_names_in(text)
    assert "ckptvault_last_good_checkpoint_age_seconds" in used
    assert used <= exposed_names(tmp_path), used - exposed_names(tmp_path)
