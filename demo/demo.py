"""ckptvault's demo: the product's main job, end to end (``make demo``).

1. Train a reference run without interruption.
2. Train the same run again and SIGKILL it at a random step.
3. Restart it: it resumes from the newest generation that verifies.
4. Damage the newest generation; a restore falls back to the previous one and says why.
5. Show that the interrupted-and-resumed run ends bit-identical to the reference.
6. Run it under ``ckptvault supervise``, preempt and kill it: it still ends
   bit-identical, and the catalog shows every attempt.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from supervised import supervised_run

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "demo-out"
STEPS, SAVE_EVERY = 300, 25
# Step 7's loop: steps, batch and save interval (an async save every 50 steps).
OVERHEAD_STEPS, OVERHEAD_SAVE_EVERY = 600, 50
console = Console(highlight=False, soft_wrap=True)


def trainer(store: Path, *extra: str) -> subprocess.Popen:
    # Later options win: callers may override --steps and --save-every.
    return subprocess.Popen(
        [
            sys.executable,
            str(HERE / "train.py"),
            str(store),
            "--steps",
            str(STEPS),
            "--save-every",
            str(SAVE_EVERY),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def events(process: subprocess.Popen):
    for line in process.stdout:
        yield json.loads(line)


def run_to_end(store: Path, *extra: str) -> list[dict]:
    process = trainer(store, *extra)
    collected = list(events(process))
    if process.wait() != 0:
        raise SystemExit(
            f"training process failed ({process.returncode}):\n{process.stderr.read()}"
        )
    return collected


def summarize(collected: list[dict]) -> dict:
    saves = [e for e in collected if e["event"] == "saved"]
    return {
        "saves": len(saves),
        "bytes": sum(e["bytes"] for e in saves),
        "save_seconds": sum(e["seconds"] for e in saves) / max(1, len(saves)),
    }


def flip_one_byte(generation: Path) -> Path:
    victim = sorted(generation.glob("*.safetensors"))[0]
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    return victim


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    started = time.perf_counter()
    console.rule("[bold]ckptvault demo")

    console.print(
        f"1. reference run: {STEPS} steps, a checkpoint every {SAVE_EVERY} steps, no interruption"
    )
    reference = run_to_end(OUT / "reference")
    reference_done = reference[-1]

    kill_at = random.randint(STEPS // 5, STEPS * 4 // 5)
    console.print(f"2. the same run again, killed with SIGKILL at step {kill_at}")
    store = OUT / "run"
    process = trainer(store)
    first_run: list[dict] = []
    for event in events(process):
        first_run.append(event)
        if event["event"] == "step" and event["step"] >= kill_at:
            process.send_signal(signal.SIGKILL)
            break
    process.wait()
    last_step = max(e["step"] for e in first_run if e["event"] == "step")
    durable = max((e["step"] for e in first_run if e["event"] == "saved"), default=None)
    console.print(f"   killed after step {last_step}; last save that returned: step {durable}")

    console.print("3. restart: resume from the newest generation that verifies")
    resumed = run_to_end(store)
    restored = resumed[0]
    console.print(
        f"   restored step {restored['step']} in {restored['seconds']:.3f} s, "
        f"continued to step {resumed[-1]['step']}"
    )

    console.print("4. damage the newest generation (flip one byte) and restore again")
    listing = json.loads(
        subprocess.run(
            [sys.executable, "-m", "ckptvault", "ls", str(store), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    newest = Path(listing[0]["path"])
    victim = flip_one_byte(newest)
    console.print(f"   flipped a byte in {victim.relative_to(OUT)}")
    fallback = run_to_end(store, "--restore-only")[0]
    for generation_id, step, reason in fallback["skipped"]:
        console.print(
            f"   [yellow]skipped[/yellow] step {step} ({generation_id}): {reason}", markup=True
        )
    console.print(f"   [green]restored[/green] step {fallback['step']} instead")
    verify = subprocess.run(
        [sys.executable, "-m", "ckptvault", "verify", str(store), "--all"],
        capture_output=True,
        text=True,
    )
    console.print(f"   `ckptvault verify --all` exits {verify.returncode}:")
    for line in verify.stdout.strip().splitlines()[:4]:
        console.print(f"     {line}", markup=False)

    identical = resumed[-1]["weights"] == reference_done["weights"]
    console.print(
        "5. interrupted-and-resumed run vs uninterrupted run: final weights "
        + ("[bold green]bit-identical[/bold green]" if identical else "[bold red]DIFFER[/bold red]")
    )

    console.print(
        "6. under `ckptvault supervise`: preempted (SIGTERM), killed (SIGKILL), preempted again"
    )
    supervised = supervised_run(OUT, STEPS, SAVE_EVERY)
    for name, step in supervised["sent"]:
        console.print(f"   sent {name} at step {step}")
    for attempt in supervised["attempts"]:
        ended = (
            f"exit {attempt['exit_code']}"
            if attempt["exit_code"] is not None
            else attempt["signal"]
        )
        console.print(f"   catalog: attempt {attempt['attempt']}: {ended} -> {attempt['decision']}")
    supervised_identical = (
        supervised["returncode"] == 0
        and supervised["done"] is not None
        and supervised["done"]["weights"] == reference_done["weights"]
    )
    console.print(
        f"   supervisor exit {supervised['returncode']}; final weights against the reference: "
        + (
            "[bold green]bit-identical[/bold green]"
            if supervised_identical
            else "[bold red]DIFFER[/bold red]"
        )
    )

    console.print(
        f"7. what checkpointing costs the training loop: {OVERHEAD_STEPS} steps, "
        f"an async save every {OVERHEAD_SAVE_EVERY}"
    )
    # Only the time spent inside save() is shown: it is measured inside the loop and
    # is stable. A wall-clock comparison with a loop that never saves swung from -39%
    # to +40% between runs on a 2-core VM (the background writer shares the cores).
    common = ("--steps", str(OVERHEAD_STEPS), "--batch", "128")
    with_saves = run_to_end(
        OUT / "overhead-async", *common, "--save-every", str(OVERHEAD_SAVE_EVERY), "--async-save"
    )[-1]
    stall_share = with_saves["stall_seconds"] / with_saves["loop_seconds"]
    console.print(
        f"   {with_saves['saves']} saves stalled training for {with_saves['stall_seconds']:.3f} s in all: "
        f"{stall_share:.2%} of the {with_saves['loop_seconds']:.2f} s loop"
        + (
            " [green](target <= 2%)[/green]"
            if stall_share <= 0.02
            else " [red](target <= 2%)[/red]"
        )
    )

    table = Table(title="summary", title_justify="left")
    for column in ("run", "steps", "saves", "bytes written", "mean save s", "restore s"):
        table.add_column(column, justify="left" if column == "run" else "right")
    ref, first, second = summarize(reference), summarize(first_run), summarize(resumed)
    table.add_row(
        "reference",
        str(STEPS),
        str(ref["saves"]),
        f"{ref['bytes'] / 1e6:.1f} MB",
        f"{ref['save_seconds']:.3f}",
        "-",
    )
    table.add_row(
        "killed",
        str(last_step + 1),
        str(first["saves"]),
        f"{first['bytes'] / 1e6:.1f} MB",
        f"{first['save_seconds']:.3f}",
        "-",
    )
    table.add_row(
        "resumed",
        str(STEPS - restored["step"] - 1),
        str(second["saves"]),
        f"{second['bytes'] / 1e6:.1f} MB",
        f"{second['save_seconds']:.3f}",
        f"{restored['seconds']:.3f}",
    )
    table.add_row("fallback", "-", "-", "-", "-", f"{fallback['seconds']:.3f}")
    console.print(table)
    console.print(f"stores kept in {OUT} ({time.perf_counter() - started:.0f} s in all)")
    if (
        not identical
        or not supervised_identical
        or len(supervised["attempts"]) != len(supervised["sent"]) + 1
        or fallback["step"] is None
        or not fallback["skipped"]
        or verify.returncode == 0
    ):
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if sys.argv[1:] == ["--quick"]:
        # The test suite's budget: every step of the demo with every claim checked,
        # on runs a third as long (as many saves, kills and restarts).
        STEPS, SAVE_EVERY, OVERHEAD_STEPS, OVERHEAD_SAVE_EVERY = 100, 8, 200, 17
    elif sys.argv[1:]:
        raise SystemExit("usage: demo.py [--quick]")
    main()
