"""``ckptvault gc``'s retention policy: the rules given, the run's recorded policy
(:mod:`ckptvault.retention.recorded`), when the record may count, and replacing it.

The record is unsigned store data. Beside rules given it only adds keeps (rules
compose by union, the longer delay wins); alone it decides only where gc takes the
store's bytes at their word anyway (no trust options). See :func:`applicable`.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
from collections.abc import Callable

import typer

from ckptvault.errors import UsageError
from ckptvault.retention.policy import (
    DEFAULT_DELETE_DELAY,
    Retention,
    RetentionRule,
    format_seconds,
)
from ckptvault.retention.recorded import policy_json, read_policy, union
from ckptvault.storage.base import Store
from ckptvault.trust.context import TrustContext

logger = logging.getLogger("ckptvault")


@dataclasses.dataclass(frozen=True)
class GcPolicy:
    """What a gc pass applies: the rules given, the run's recorded policy (only ever
    added: rules compose by union, the longer delay wins), and how to say so."""

    rules: tuple[RetentionRule, ...]
    delete_delay: float
    described: str

    @classmethod
    def of(
        cls, given: Retention | None, recorded: Retention | None, delay: float | None
    ) -> GcPolicy:
        rules, delete_delay = union(given, recorded)
        if delay is not None and given is None:
            delete_delay = max(delete_delay, delay)  # --delete-delay with no rule options
        elif given is None and recorded is None:
            delete_delay = DEFAULT_DELETE_DELAY  # finishing earlier marks, as ever
        parts = [given.describe() if given is not None else "no rule given"]
        if recorded is not None:
            parts.append(f"recorded policy: {recorded.describe()}")
        applied = "both" if given is not None else "the recorded policy"
        if recorded is not None:
            parts.append(f"applied: {applied}, delete_delay={format_seconds(delete_delay)}")
        elif given is None:
            parts.append(f"delete_delay={format_seconds(delete_delay)}")
        return cls(rules, delete_delay, "; ".join(parts))


def applicable(
    recorded: Retention | None, given: Retention | None, trust: TrustContext
) -> Retention | None:
    """The recorded policy this pass may apply. Nothing authenticates the record: it
    is store data, whoever can write the store can plant one. Beside rules given it
    only adds keeps (the union), so it always counts there. Alone it would decide what
    is marked and deleted: that only where gc takes the store's own bytes at their
    word anyway (no --trusted-key, --keystore or --ledger: a store writer could plant
    generations or deletion marks as well). Where those options make gc accept only
    what they authenticate, an unauthenticated record deciding alone would let a store
    writer delete signed generations (DESIGN rule 7): it is then not applied, and
    this pass only finishes earlier marks."""
    if recorded is None or given is not None:
        return recorded
    if trust.trusted is None and trust.keystore is None and trust.ledger is None:
        return recorded
    logger.warning(
        "the retention policy recorded in the store (%s) is not applied alone: nothing "
        "authenticates it, and the trust options given accept only what they "
        "authenticate; gc only finishes earlier marks. To apply those rules, give them: "
        "ckptvault gc STORE %s",
        recorded.describe(),
        _as_options(recorded),
    )
    return None


def _as_options(policy: Retention) -> str:
    """``--keep-last 3 --keep-best 1 --metric loss ...``: the options stating ``policy``."""
    parts = []
    for name, value in policy_json(policy).items():
        if name in ("keep_within", "delete_delay"):  # seconds, as --keep-within reads them
            value = f"{value:f}".rstrip("0").rstrip(".") + "s"
        parts.append(f"--{name.replace('_', '-')} {shlex.quote(str(value))}")
    return " ".join(parts)


def confirm_replacement(
    store: Store,
    given: Retention | None,
    run: str | None,
    confirmed: bool,
    preview: Callable[[], None],
) -> None:
    """Check a --replace-policy request; unless ``confirmed`` (--yes, or --dry-run,
    which is the preview itself), show ``preview`` (what the new rules alone would
    do) and ask before going on: no terminal to ask is a refusal."""
    if given is None:
        raise UsageError("--replace-policy needs the rules to record (--keep-last N, ...)")
    if run is None:
        raise UsageError(
            f"store {store.location} holds no generation these trust options accept, so no "
            "run whose policy to replace; pass --run-id"
        )
    if confirmed:
        return
    preview()
    recorded = read_policy(store, run, quiet=True)
    question = (
        f"replace the recorded policy ({recorded.describe() if recorded else 'none'}) with "
        f"{given.describe()} and apply it now?"
    )
    if not sys.stdin.isatty():
        raise UsageError(f"nothing changed: {question} Pass --yes to confirm")
    if not typer.confirm(question, err=True):
        raise UsageError("nothing changed: the recorded policy stays")
