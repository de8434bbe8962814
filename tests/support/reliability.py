"""Reliability figures: how many trials each fault scenario ran and how many failed.

Every reliability test (crash kills, simulated power loss, corruption, hostile
inputs, fuzzing) calls :func:`record` once per scenario with its trial count and
failure count, *before* it asserts that there were no failures, so the figures are
written even when a test fails. ``make reliability`` points
``CKPTVAULT_RELIABILITY_LOG`` at a JSON-lines file and prints the table from it
(``tests/support/reliability_table.py``); under plain ``make test`` nothing is written.

:func:`budget` picks a scenario's trial count: the bounded CI figure by default,
the long figure under ``make reliability`` (``CKPTVAULT_RELIABILITY_LONG=1``).
"""

from __future__ import annotations

import json
import os
import time

LOG_ENV = "CKPTVAULT_RELIABILITY_LOG"
LONG_ENV = "CKPTVAULT_RELIABILITY_LONG"


def long_run() -> bool:
    """Whether the long budgets apply (``make reliability`` / ``make fuzz``)."""
    return os.environ.get(LONG_ENV, "") not in ("", "0")


def budget(ci: int, long: int) -> int:
    """The number of trials to run: ``ci`` in ``make test``, ``long`` in the long run."""
    return long if long_run() else ci


def record(scenario: str, trials: int, failures: int, detail: str = "") -> None:
    """Append one scenario's figures to the reliability log, when one is configured.

    Call it before asserting ``failures == 0``: a failing scenario must still show in
    the table. ``detail`` is a short free-text note (the seed, what was counted).
    """
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps(
        {
            "scenario": scenario,
            "trials": int(trials),
            "failures": int(failures),
            "detail": detail,
            "time": time.time(),
        }
    )
    with open(path, "a", encoding="utf-8") as log:
        log.write(line + "\n")
