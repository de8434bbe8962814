"""The errors reference (``docs/reference/errors.md``), from the code itself.

- the classes of ``ckptvault.errors.__all__``: their hierarchy, bases and docstrings,
  each linked to its API entry (a link that does not resolve fails the strict build);
- the exit statuses they lead to: 2 on the command line, and for a training job the
  codes of ``ckptvault.exit_codes`` whose comments name the class;
- the reason codes of the restore checks (``ckptvault.trust.problems``), each with
  the rule that sets it, as the docstring of ``ckptvault.trust.checks`` states it.
"""

from __future__ import annotations

import re
from pathlib import Path

from reference_cli import ERROR
from reference_text import cell, in_module, int_constants, paragraphs, str_constants, table

import ckptvault.exit_codes
import ckptvault.trust.checks
import ckptvault.trust.problems
from ckptvault import errors
from ckptvault.saving.preemption import Preempted

SRC = Path(errors.__file__).parent


def error_classes() -> list[type[BaseException]]:
    """The public error classes, in the module's order of definition."""
    classes = [getattr(errors, name) for name in errors.__all__]
    return sorted(classes, key=lambda cls: list(vars(errors)).index(cls.__name__))


def errors_markdown() -> str:
    """The whole generated part of the page."""
    return (
        "\n\n".join(
            [
                paragraphs(errors.__doc__, in_module(errors)),
                "## Hierarchy",
                _hierarchy(errors.CheckpointError, 0),
                _exit_statuses(),
                "## The errors",
                *(_error(cls) for cls in error_classes()),
                _reason_codes(),
            ]
        )
        + "\n"
    )


def _hierarchy(cls: type[BaseException], depth: int) -> str:
    public = set(error_classes())
    others = [base.__name__ for base in cls.__bases__ if base not in public]
    also = f" (also a `{'`, `'.join(others)}`)" if others and depth else ""
    line = f"{'    ' * depth}- [`{cls.__name__}`](#{cls.__name__.lower()}){also}"
    children = [sub for sub in cls.__subclasses__() if sub in public]
    return "\n".join([line, *(_hierarchy(sub, depth + 1) for sub in children)])


def _error(cls: type[BaseException]) -> str:
    bases = ", ".join(f"`{base.__name__}`" for base in cls.__bases__)
    job = [
        f"`{code}` (`{name}`)"
        for name, code, _ in _job_codes()
        if cls.__name__ in _comment_of(name)
    ]
    facts = [f"Bases: {bases}", f"[API][ckptvault.errors.{cls.__name__}]"]
    facts.append(f"command line: exit `{ERROR}`")
    if job:
        facts.append("`ckptvault.exit_codes`: " + ", ".join(job))
    return "\n\n".join(
        [f"### {cls.__name__}", " · ".join(facts), paragraphs(cls.__doc__, in_module(errors))]
    )


def _exit_statuses() -> str:
    rows = [[f"`{code}`", f"`{name}`", cell(comment)] for name, code, comment in _job_codes()]
    preempted = Preempted(None, "SIGTERM").code
    return "\n\n".join(
        [
            "## Exit statuses",
            f"On the command line every one of these errors ends the command with exit status "
            f"`{ERROR}` and one line on stderr (see [the command line's exit statuses]"
            "(cli.md#exit-statuses)). A training job that lets one escape exits 1, as Python "
            "does, unless it maps it to one of the codes of `ckptvault.exit_codes`, which "
            "`ckptvault supervise` acts on:",
            table(["Status", "Constant", "Meaning (from the code)"], rows),
            f"[`ckptvault.Preempted`][ckptvault.Preempted] is not an error: a `SystemExit` "
            f"with status `{preempted}`, raised by `save()` after the final save of a "
            "preempted job.",
        ]
    )


def _job_codes() -> list[tuple[str, int, str]]:
    return int_constants(ckptvault.exit_codes, ["PREEMPTED", "PERMANENT_FAILURE"])


def _comment_of(name: str) -> str:
    return next(comment for n, _, comment in _job_codes() if n == name)


def reason_codes() -> list[tuple[str, str, str]]:
    """``(constant, code, comment)`` of every reason code of the restore checks."""
    return str_constants(ckptvault.trust.problems)


def _reason_codes() -> str:
    rows = [
        [f"`{code}`", f"`{name}`", cell(_rule(code, name, comment))]
        for name, code, comment in reason_codes()
    ]
    return "\n\n".join(
        [
            "## Reason codes of the restore checks",
            paragraphs(ckptvault.trust.problems.__doc__),
            "A generation that fails a check is skipped with these codes in its reason "
            "(`NoValidCheckpoint.rejected`, `ckptvault verify`). The checks, as "
            "`ckptvault.trust.checks` states them:",
            paragraphs(ckptvault.trust.checks.__doc__, in_module(ckptvault.trust.checks)),
            table(["Code", "Constant", "Set by"], rows),
        ]
    )


def _rule(code: str, name: str, comment: str) -> str:
    """What sets ``code``: the numbered rule of the checks' docstring that names it
    (or the function its paragraph is about), else the constant's own comment, else
    the modules that use the constant."""
    doc = ckptvault.trust.checks.__doc__ or ""
    for part in re.split(r"\n\s*\n|\n(?=\d+\. )", doc):
        if f"``{code}``" in part:
            number = re.match(r"\s*(\d+)\.", part)
            function = re.search(r":func:`(\w+)`", part)
            if number:
                return f"rule {number[1]}"
            if function:
                return f"`{function[1]}`"
    if comment and name != reason_codes()[0][0]:  # the first one's is the block's heading
        return comment
    users = sorted(
        ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        for path in SRC.rglob("*.py")
        if path.name != "problems.py" and re.search(rf"\b{name}\b", path.read_text())
    )
    return "set in " + ", ".join(f"`{user}`" for user in users)
