"""The cadence planner: the seeds' worked examples, the sizing and storage answers,
and ``ckptvault plan`` as a user runs it (JSON, table, plot, bad inputs)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.cli import main
from ckptvault.errors import UsageError
from ckptvault.planning.cadence import (
    PlanInputs,
    daly_interval,
    first_order_overhead_fraction,
    interval_steps,
    job_mtbf_seconds,
    lost_work_seconds,
    overhead_fraction,
    plan_cadence,
    seconds_to_steps,
    young_interval,
)
from ckptvault.planning.sizing import (
    RECIPES,
    bytes_per_param,
    checkpoint_bytes,
    parse_count,
    parse_keep,
    required_write_bytes_per_s,
    storage_forecast,
)
from support.common import make_training_state, run_cli, train_steps

HOUR = 3600.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    """``ckptvault plan ARGS --json``, in process; its stdout must be pure JSON."""
    code = main(["plan", *args, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def exact_optimum(c: float, m: float, r: float = 0.0) -> float:
    """The minimum of Daly's full model, by golden-section search."""
    low, high = 1e-3 * math.sqrt(c * m), 10 * math.sqrt(c * m) + m
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if overhead_fraction(a, c, m, r) < overhead_fraction(b, c, m, r):
            high = b
        else:
            low = a
    return (low + high) / 2


def test_young_interval_matches_the_seeds_worked_examples():
    # seed 004: C=10 s, M=4 h: sqrt(2*10*14400) = 536.7 s; seed 002: M=24 h: ~1314 s
    assert young_interval(10, 4 * HOUR) == pytest.approx(536.66, abs=0.01)
    assert young_interval(10, 24 * HOUR) == pytest.approx(1314.53, abs=0.01)


def test_daly_interval_matches_the_issue_example_and_the_exact_optimum():
    daly = daly_interval(10, 4 * HOUR)
    assert daly == pytest.approx(530.0, abs=0.1)
    # Daly's estimate is nearer the full model's minimum than Young's, and very near.
    optimum = exact_optimum(10, 4 * HOUR)
    assert abs(daly - optimum) < abs(young_interval(10, 4 * HOUR) - optimum)
    assert daly == pytest.approx(optimum, rel=2e-3)
    # ... also where the save is a sizeable part of the MTBF (C = M/10).
    assert daly_interval(360, HOUR) == pytest.approx(exact_optimum(360, HOUR), rel=0.02)


@pytest.mark.parametrize("factor", [2.0, 3.0, 50.0])
def test_daly_falls_back_to_the_mtbf_when_a_save_takes_twice_the_mtbf(factor: float):
    m = HOUR
    assert daly_interval(factor * m, m) == m
    assert daly_interval(1.999 * m, m) != m  # the series still applies just below


def test_overhead_models_agree_while_saves_are_short_and_include_restart():
    c, m = 10.0, 4 * HOUR
    young = young_interval(c, m)
    # At Young's interval the first-order model is exactly sqrt(2C/M) (+ R/M).
    assert first_order_overhead_fraction(young, c, m) == pytest.approx(math.sqrt(2 * c / m))
    assert first_order_overhead_fraction(young, c, m, 600) == pytest.approx(
        math.sqrt(2 * c / m) + 600 / m
    )
    assert overhead_fraction(young, c, m) == pytest.approx(math.sqrt(2 * c / m), rel=0.05)
    assert overhead_fraction(young, c, m, 600) > overhead_fraction(young, c, m, 0)
    # Too short and too long intervals both cost more than the optimum.
    best = overhead_fraction(daly_interval(c, m), c, m)
    assert overhead_fraction(young / 4, c, m) > best < overhead_fraction(young * 4, c, m)
    assert overhead_fraction(1e9, c, m) == math.inf


def test_lost_work_is_half_an_interval_plus_restart_in_seconds_and_steps():
    assert lost_work_seconds(600, 120) == 420
    assert seconds_to_steps(420, 2.0) == 210
    assert interval_steps(530.01, 2.0) == 265
    assert interval_steps(5, 30) == 1  # a step longer than the interval: every step


def test_job_mtbf_from_nodes_divides_the_node_mtbf():
    # seed 002: 1250 nodes at 3 years each fail about every 21 hours.
    assert job_mtbf_seconds(1250, 3) / HOUR == pytest.approx(21.04, abs=0.01)
    assert job_mtbf_seconds(1, 1) == pytest.approx(365.25 * 24 * HOUR)
    with pytest.raises(UsageError, match="--nodes"):
        job_mtbf_seconds(0, 3)


@pytest.mark.parametrize(
    "call",
    [
        lambda: young_interval(0, HOUR),
        lambda: young_interval(10, -1),
        lambda: daly_interval(math.nan, HOUR),
        lambda: overhead_fraction(100, 10, math.inf),
        lambda: lost_work_seconds(100, -1),
        lambda: seconds_to_steps(100, 0),
    ],
)
def test_formulas_refuse_values_out_of_range(call):
    with pytest.raises(UsageError):
        call()


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("70e9", 70 * 10**9),
        ("7.5e9", 7_500_000_000),
        ("70B", 70 * 10**9),
        ("7b", 7 * 10**9),
        ("1.5T", 1_500_000_000_000),
        ("125M", 125_000_000),
        ("70_000_000_000", 70 * 10**9),
        ("70000000000", 70 * 10**9),
    ],
)
def test_parameter_counts_in_the_ways_people_write_them(text: str, count: int):
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["-5", "0", "abc", "70X", "1e-3", "", "7 0B"])
def test_parameter_counts_that_are_not_counts_are_refused(text: str):
    with pytest.raises(UsageError, match="--params"):
        parse_count(text)


def test_checkpoint_size_from_parameters_and_recipes():
    assert RECIPES["mixed-adam"][0] == 14
    # seed 002 / the issue: 70e9 parameters x 14 B = 980 GB
    assert checkpoint_bytes(parse_count("70e9"), bytes_per_param("mixed-adam", None)) == 980 * 10**9
    assert checkpoint_bytes(7 * 10**9, bytes_per_param(None, 2.5)) == 17_500_000_000
    assert bytes_per_param(None, None) is None
    with pytest.raises(UsageError, match="not both"):
        bytes_per_param("mixed-adam", 14)
    with pytest.raises(UsageError, match="mixed-adam"):
        bytes_per_param("adam-ish", None)


def test_bandwidth_that_keeps_the_stall_under_the_limit():
    assert required_write_bytes_per_s(980 * 10**9, 10) == 98 * 10**9
    with pytest.raises(UsageError, match="--stall-seconds"):
        required_write_bytes_per_s(10, 0)


def test_storage_forecast_per_tier_counts_kept_in_flight_and_staging():
    size = 10**9
    forecast = storage_forecast(size, parse_keep(["local=3", "s3=10"]), max_in_flight=2)
    tiers = {tier.tier: tier.bytes for tier in forecast.tiers}
    assert tiers == {"local": 5 * size, "s3": 12 * size}
    assert forecast.total_bytes == 17 * size
    assert forecast.staging_bytes == 2 * size
    single = storage_forecast(size, parse_keep(["3"]))
    assert [(t.tier, t.bytes) for t in single.tiers] == [("store", 4 * size)]
    assert single.staging_bytes == size


@pytest.mark.parametrize("values", [["local=0"], ["x=y"], ["3", "4"], ["a=1", "a=2"], ["=3"]])
def test_keep_values_that_cannot_be_read_are_refused(values: list[str]):
    with pytest.raises(UsageError, match="--keep"):
        parse_keep(values)


def test_plan_leaves_out_what_its_inputs_do_not_determine():
    sized_only = plan_cadence(PlanInputs(checkpoint_bytes=100, stall_seconds=4))
    assert sized_only.required_write_bytes_per_s == 25
    assert sized_only.young_interval_s is None and sized_only.storage is None
    no_steps = plan_cadence(PlanInputs(save_seconds=10, mtbf_seconds=4 * HOUR))
    assert no_steps.daly_interval_s is not None and no_steps.interval_steps is None


def test_plan_json_answers_the_worked_example(capsys):
    answer = plan_json(
        capsys,
        "--save-seconds", "10", "--mtbf-hours", "4", "--step-seconds", "2",
        "--restore-seconds", "60", "--params", "70e9", "--recipe", "mixed-adam",
        "--stall-seconds", "10", "--keep", "local=3", "--keep", "s3=10",
        "--max-in-flight", "2",
    )  # fmt: skip
    assert answer["young_interval_s"] == pytest.approx(536.66, abs=0.01)
    assert answer["daly_interval_s"] == pytest.approx(530.0, abs=0.1)
    assert answer["interval_s"] == answer["daly_interval_s"]
    assert answer["interval_steps"] == 265 and answer["young_interval_steps"] == 268
    assert answer["lost_work_s"] == pytest.approx(answer["daly_interval_s"] / 2 + 60)
    assert answer["lost_work_steps"] == pytest.approx(answer["lost_work_s"] / 2)
    assert 0.038 < answer["overhead_fraction"] < 0.043  # ~sqrt(2C/M) + R/M
    assert answer["checkpoint_bytes"] == 980 * 10**9
    assert answer["required_write_bytes_per_s"] == 98 * 10**9
    assert answer["sustained_write_bytes_per_s"] == pytest.approx(980e9 / 530.0, rel=1e-3)
    storage = answer["storage"]
    assert storage["tiers"]["local"] == {"kept": 3, "in_flight": 2, "bytes": 5 * 980 * 10**9}
    assert storage["tiers"]["s3"]["bytes"] == 12 * 980 * 10**9
    assert storage["staging_bytes"] == 2 * 980 * 10**9
    assert answer["params"] == 70 * 10**9 and answer["recipe"] == "mixed-adam"
    assert answer["sources"]["checkpoint_bytes"] == "--params"


def test_plan_json_from_nodes_and_a_day_mtbf(capsys):
    day = plan_json(capsys, "--save-seconds", "10", "--mtbf-hours", "24")
    assert day["young_interval_s"] == pytest.approx(1314.5, abs=0.1)
    assert day["checkpoint_bytes"] is None and day["required_write_bytes_per_s"] is None
    nodes = plan_json(capsys, "--save-seconds", "10", "--nodes", "1250", "--node-mtbf-years", "3")
    assert nodes["mtbf_s"] / HOUR == pytest.approx(21.04, abs=0.01)


def test_plan_sizes_without_an_interval(capsys):
    answer = plan_json(capsys, "--params", "7B", "--bytes-per-param", "2", "--stall-seconds", "7")
    assert answer["checkpoint_bytes"] == 14 * 10**9
    assert answer["required_write_bytes_per_s"] == 2 * 10**9
    assert answer["young_interval_s"] is None and answer["daly_interval_s"] is None


def test_plan_warns_when_a_save_takes_twice_the_mtbf(capsys):
    answer = plan_json(capsys, "--save-seconds", "7200", "--mtbf-hours", "1")
    assert answer["daly_interval_s"] == HOUR
    assert any("twice the MTBF" in warning for warning in answer["warnings"])


def test_plan_table_as_a_user_runs_it():
    result = run_cli(
        "plan", "--save-seconds", "10", "--mtbf-hours", "4", "--step-seconds", "2",
        "--params", "70e9", "--recipe", "mixed-adam", "--stall-seconds", "10",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "8 min 50 s (every 265 steps)" in result.stdout  # Daly
    assert "8 min 57 s (every 268 steps)" in result.stdout  # Young
    assert "980 GB" in result.stdout and "98 GB/s" in result.stdout


def test_plot_writes_a_png_with_the_tradeoff(tmp_path: Path, capsys):
    figure = tmp_path / "cadence.png"
    answer = plan_json(capsys, "--save-seconds", "10", "--mtbf-hours", "4", "--plot", str(figure))
    data = figure.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert answer["plot"] == str(figure)


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path):
    # A fresh interpreter in which importing matplotlib fails, as where it is absent.
    code = (
        "import sys; sys.modules['matplotlib'] = None; from ckptvault.cli import main; "
        f"sys.exit(main(['plan', '--save-seconds', '10', '--mtbf-hours', '4', "
        f"'--plot', {str(tmp_path / 'x.png')!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2
    assert "pip install 'ckptvault[plot]'" in result.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--save-seconds", "-5", "--mtbf-hours", "4"], "--save-seconds must be"),
        (["--save-seconds", "0", "--mtbf-hours", "4"], "--save-seconds must be"),
        (["--save-seconds", "nan", "--mtbf-hours", "4"], "--save-seconds must be"),
        (["--save-seconds", "10", "--mtbf-hours", "0"], "--mtbf-hours must be"),
        (["--save-seconds", "10"], "needs the MTBF"),
        (["--mtbf-hours", "4"], "--save-seconds"),
        (["--save-seconds", "10", "--mtbf-hours", "4", "--restore-seconds", "-1"], "--restore"),
        (["--save-seconds", "10", "--mtbf-hours", "4", "--step-seconds", "0"], "--step-seconds"),
        (["--step-seconds", "2", "--params", "7B", "--recipe", "mixed-adam"], "--step-seconds"),
        (["--save-seconds", "10", "--mtbf-hours", "4", "--stall-seconds", "5"], "--params"),
        (["--save-seconds", "10", "--mtbf-hours", "4", "--keep", "3"], "--keep"),
        (["--params", "7B", "--recipe", "mixed-adam", "--stall-seconds", "0"], "--stall-seconds"),
        (["--params", "7B", "--recipe", "mixed-adam", "--max-in-flight", "2"], "--keep"),
        (["--params", "7B", "--recipe", "mixed-adam", "--keep", "3", "--max-in-flight", "0"],
         "--max-in-flight"),
        (["--params", "70e9"], "--recipe"),
        (["--params", "1e308", "--recipe", "mixed-adam"], "too large"),
        (["--save-seconds", "10", "--mtbf-hours", "4", "--step-seconds", "5e-324"], "step time"),
        (["--params", "lots", "--recipe", "mixed-adam"], "--params"),
        (["--params", "7B", "--recipe", "adam-ish"], "unknown --recipe"),
        (["--recipe", "mixed-adam"], "--params"),
        (["--save-seconds", "10", "--mtbf-hours", "4", "--nodes", "8"], "not both"),
        (["--save-seconds", "10", "--nodes", "8"], "--node-mtbf-years"),
        (["--save-seconds", "10", "--nodes", "0", "--node-mtbf-years", "3"], "--nodes"),
        (["--save-seconds", "10", "--mtbf-hours", "4", "--plot", "x.txt"], ".png"),
        (["--params", "7B", "--recipe", "mixed-adam", "--plot", "x.png"], "--plot"),
        (["--catalog", "c.sqlite3", "--params", "7B", "--recipe", "mixed-adam"], "--from"),
        ([], "nothing to plan"),
    ],
)  # fmt: skip
def test_bad_inputs_give_one_line_and_exit_2(args: list[str], fragment: str, capsys, tmp_path):
    code = main(["plan", *args])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptvault: error:"), captured.err
    assert fragment in lines[0]
    assert captured.out == ""


@pytest.fixture
def saved_store(store: Path) -> Path:
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="plan") as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            mgr.save(step, state)
    return store


def test_plan_from_a_store_takes_the_newest_generations_size(saved_store: Path, capsys):
    newest = json.loads(run_cli("ls", str(saved_store), "--json").stdout)[0]
    answer = plan_json(
        capsys, "--from", str(saved_store), "--save-seconds", "3", "--mtbf-hours", "4",
        "--stall-seconds", "2", "--keep", "2",
    )  # fmt: skip
    assert answer["checkpoint_bytes"] == newest["bytes"] > 0
    assert answer["required_write_bytes_per_s"] == newest["bytes"] / 2
    assert answer["storage"]["tiers"]["store"]["bytes"] == 3 * newest["bytes"]
    assert answer["sources"]["checkpoint_bytes"] == f"store, step {newest['step']}"
    assert answer["sources"]["save_seconds"] == "--save-seconds"


def test_plan_from_a_store_without_recorded_saves_asks_for_the_save_cost(
    saved_store: Path, tmp_path: Path, capsys
):
    code = main(["plan", "--from", str(saved_store), "--mtbf-hours", "4",
                 "--catalog", str(tmp_path / "absent.sqlite3")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--save-seconds" in err and "absent.sqlite3" in err


def test_plan_from_an_empty_store_asks_for_params(tmp_path: Path, capsys):
    (tmp_path / "empty").mkdir()
    code = main(["plan", "--from", str(tmp_path / "empty")])
    assert code == 2 and "--params" in capsys.readouterr().err


def test_plan_from_a_store_takes_the_save_cost_from_the_catalog(store: Path, capsys):
    # Saves through a real manager are recorded in the default catalog (beside the
    # ledger, in this test's state directory); the planner reads their stalls back.
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="plan") as mgr:
        for step in (1, 2, 3):
            train_steps(state, 1)
            mgr.save(step, state)
    from ckptvault.observe.catalog import Catalog, default_catalog_path
    from ckptvault.trust.ledger import default_ledger_path

    with Catalog(default_catalog_path(default_ledger_path())) as catalog:
        stalls = [s.stall_seconds for s in catalog.recent_saves() if s.ok]
    assert len(stalls) == 3
    answer = plan_json(capsys, "--from", str(store), "--mtbf-hours", "4")
    assert answer["save_seconds"] == pytest.approx(sorted(stalls)[1])  # the median
    assert answer["sources"]["save_seconds"] == "catalog: median stall of 3 saves"
    assert answer["young_interval_s"] == pytest.approx(math.sqrt(2 * sorted(stalls)[1] * 4 * HOUR))
    # --save-seconds still wins over what the catalog measured.
    given = plan_json(capsys, "--from", str(store), "--mtbf-hours", "4", "--save-seconds", "9")
    assert given["save_seconds"] == 9


def test_plan_from_a_store_the_catalog_does_not_know_asks_for_the_save_cost(
    store: Path, tmp_path: Path, capsys
):
    catalog = tmp_path / "elsewhere" / "catalog.sqlite3"
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="plan", catalog=catalog) as mgr:
        mgr.save(1, state)
    other = tmp_path / "other"
    with cv.CheckpointManager(other, run_id="other", catalog=False) as mgr:
        mgr.save(1, state)
    code = main(["plan", "--from", str(other), "--mtbf-hours", "4", "--catalog", str(catalog)])
    err = capsys.readouterr().err
    assert code == 2 and "no successful save" in err and "--save-seconds" in err
    answer = plan_json(capsys, "--from", str(store), "--mtbf-hours", "4", "--catalog", str(catalog))
    assert answer["save_seconds"] > 0
