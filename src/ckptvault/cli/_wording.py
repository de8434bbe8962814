"""Error messages in the command line's words: its flags, not the library's arguments.

The library's errors name what a Python caller passes (``pass keystore= to read
it``, ``Retention(keep_best=...) needs metric=NAME``, ``s3_endpoint_url='x' is not a
URL``); a command that reaches the same check should name the flag its user typed.
Rather than each command catching and rewording each error, :func:`cli_wording`
rewrites, in the one line the CLI prints, every ``name=`` spelling of an argument
that a command takes as a flag (the table below), with a value after it when there
is one (``--metric NAME``), and the ``Retention(...)`` call around it when there is
one. A setting no flag spells (``catalog=False``) and anything else is left as it is.
"""

from __future__ import annotations

import re

# Library argument -> the flag the commands take for it.
FLAGS = {
    "keystore": "--keystore",
    "trusted_keys": "--trusted-key",
    "signing_key": "--signing-key",
    "ledger": "--ledger",
    "audit_log": "--audit-log",
    "catalog": "--catalog",
    "run_id": "--run-id",
    "step": "--step",
    "dtype": "--dtype",
    "s3_endpoint_url": "--s3-endpoint-url",
    "abandon_unverified": "--abandon-unverified",
    "keep_last": "--keep-last",
    "keep_every": "--keep-every",
    "keep_best": "--keep-best",
    "keep_within": "--keep-within",
    "keep_hourly": "--keep-hourly",
    "keep_daily": "--keep-daily",
    "keep_weekly": "--keep-weekly",
    "metric": "--metric",
    "mode": "--mode",
    "delete_delay": "--delete-delay",
    "out": "--out",
    "max_shard_size": "--max-shard-size",
    "prefix": "--prefix",
    "generations": "--generations",
}

_SPELLING = re.compile(
    r"(?P<call>\b[A-Z][A-Za-z]*\()?"  # Retention(
    r"\b(?P<name>" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")="
    r"(?P<value>\.\.\.|[^\s,;)]*)"  # ..., a placeholder (NAME), a value ('x', 3) or nothing
    r"(?P<close>\))?"
)


def _flag(match: re.Match[str]) -> str:
    value = match.group("value")
    if value in ("True", "False", "None"):
        return match.group()  # catalog=False: a Python setting no flag spells
    text = FLAGS[match.group("name")] + (f" {value}" if value and value != "..." else "")
    call, close = match.group("call"), match.group("close")
    if call and close:
        return text  # Retention(keep_last=3) -> --keep-last 3
    return (call or "") + text + (close or "")


# A message for both audiences names both: ``signing_key= (--signing-key)``.
_REPEATED = re.compile(r"(--[a-z0-9-]+) \(\1\)")


def cli_wording(message: str) -> str:
    """``message`` with the library's argument spellings replaced by the flags."""
    return _REPEATED.sub(r"\1", _SPELLING.sub(_flag, message))
