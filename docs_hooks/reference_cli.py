"""The command-line reference (``docs/reference/cli.md``), from the typer app itself.

Commands, usage lines, help, arguments and options come from click's introspection
of the app (``typer.main.get_command``), so a new command or option appears without
anyone writing it down. Exit statuses come from the code: the constants the command
line, a job and ``supervise`` exit with (and the comments beside them), and for each
command the ``typer.Exit(N)`` its callback can reach in its module.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import typer
from reference_text import cell, in_module, int_constants, paragraphs, table

import ckptvault.cli
import ckptvault.exit_codes
import ckptvault.ops.supervise
from ckptvault.cli import _interrupt

PROGRAM = "ckptvault"
ERROR = 2  # what ckptvault.cli._main returns for a ckptvault, OS, usage or cloud error
SUPERVISE_CODES = ("DONE_MISMATCH", "NO_SPACE", "CANNOT_EXECUTE", "NOT_FOUND")

Command = Any  # a click command of typer's own copy of click (typer._click)
Context = Any


def commands(app: typer.Typer | None = None) -> Iterator[tuple[str, Command, Context]]:
    """``(full name, command, context)`` of every command that runs something
    (``"keys rotate"``, not the ``keys`` group), in the app's order."""
    root = typer.main.get_command(app or ckptvault.cli.app)
    yield from _walk(root, root.context_class(root, info_name=PROGRAM), [])


def _walk(
    command: Command, ctx: Context, path: list[str]
) -> Iterator[tuple[str, Command, Context]]:
    for name, sub in getattr(command, "commands", {}).items():
        if sub.hidden:
            continue
        sub_ctx = sub.context_class(sub, info_name=name, parent=ctx)
        if getattr(sub, "commands", None):
            yield from _walk(sub, sub_ctx, [*path, name])
        else:
            yield " ".join([*path, name]), sub, sub_ctx


def documented_params(command: Command) -> list[Any]:
    """The arguments and options a user sees in ``--help`` (hidden ones are test hooks)."""
    return [param for param in command.params if not param.hidden]


def cli_markdown() -> str:
    """The whole generated part of the page."""
    root = typer.main.get_command(ckptvault.cli.app)
    root_ctx = root.context_class(root, info_name=PROGRAM)
    parts = [
        paragraphs(root.help),
        f"```text\n{root.get_usage(root_ctx).removeprefix('Usage: ')}\n```",
        "Options of `ckptvault` itself (every command also takes `--help`):",
        _params_table(root, root_ctx),
        _exit_statuses(),
    ]
    for name, command, ctx in commands():
        parts.append(_command(name, command, ctx))
    return "\n\n".join(parts) + "\n"


def _command(name: str, command: Command, ctx: Context) -> str:
    parts = [
        f"## {PROGRAM} {name}",
        f"```text\n{command.get_usage(ctx).removeprefix('Usage: ')}\n```",
        paragraphs(
            command.help, in_module(sys.modules[inspect.unwrap(command.callback).__module__])
        ),
    ]
    if documented_params(command):
        parts.append(_params_table(command, ctx))
    codes = ", ".join(f"`{code}`" for code in exit_codes(command))
    if returns_status(command):  # supervise: the status is computed; its help says how
        codes = f"its own, as its description says; {codes} as every command"
    said = " ".join(_exit_sentences(command))
    parts.append(f"Exit status: {codes} (see [Exit statuses](#exit-statuses)). {said}".strip())
    return "\n\n".join(parts)


def returns_status(command: Command) -> bool:
    """Whether the command's callback returns its exit status (``-> int``)."""
    annotation = inspect.signature(inspect.unwrap(command.callback)).return_annotation
    return annotation in (int, "int")


def _exit_sentences(command: Command) -> list[str]:
    """What the command's module docstring says about its exit status, when the
    module holds this command alone (its help says the rest)."""
    module = inspect.unwrap(command.callback).__module__
    if _command_modules().count(module) > 1:
        return []
    text = " ".join((sys.modules[module].__doc__ or "").split())
    sentences = re.split(r"(?<=[.;])\s+(?=[A-Z`(])", text)
    return [cell(s) for s in sentences if re.search(r"\bexit\b.*\d", s, re.IGNORECASE)]


@functools.cache
def _command_modules() -> list[str]:
    return [inspect.unwrap(command.callback).__module__ for _, command, _ in commands()]


def _params_table(command: Command, ctx: Context) -> str:
    rows = []
    for param in documented_params(command):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        help_text = param.help or ""
        if param.required:
            help_text += " (required)"
        low, high = getattr(param, "min", None), getattr(param, "max", None)
        if low is not None or high is not None:
            help_text += f" Range: {'' if low is None else low}..{'' if high is None else high}."
        if param.envvar:
            help_text += f" Environment variable: `{param.envvar}`."
        rows.append([f"`{record[0]}`", cell(help_text), cell(_default(param, ctx))])
    return table(["Argument or option", "Description", "Default"], rows)


def _default(param: Any, ctx: Context) -> str:
    if isinstance(param.show_default, str):
        return param.show_default
    if param.show_default is False:
        return ""
    value = param.get_default(ctx, call=False)
    if value is None or (getattr(param, "is_flag", False) and value is False):
        return ""
    if callable(value):
        return "(computed)"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return str(getattr(value, "value", value))  # an Enum shows its value


def _exit_statuses() -> str:
    every_command = [
        ["`0`", "Success."],
        ["`1`", "Something the command checked does not pass (the commands that list it)."],
        [f"`{ERROR}`", "An error; one line on stderr says what is wrong."],
        *_constant_rows(ckptvault.cli, ["INTERNAL_ERROR"]),
        *_constant_rows(_interrupt, ["INTERRUPTED"]),
    ]
    cli_doc = [p for p in ckptvault.cli.__doc__.split("\n\n") if "exit" in p.lower()]
    return "\n\n".join(
        [
            "## Exit statuses",
            paragraphs("\n\n".join(cli_doc)),
            table(["Status", "Every command"], every_command),
            paragraphs(ckptvault.exit_codes.__doc__),
            table(
                ["Status", "A training job"],
                _constant_rows(ckptvault.exit_codes, ["PREEMPTED", "PERMANENT_FAILURE"]),
            ),
            "`ckptvault supervise` passes the job's status on, or exits with its own:",
            table(
                ["Status", "`ckptvault supervise`"],
                _constant_rows(ckptvault.ops.supervise, SUPERVISE_CODES),
            ),
        ]
    )


def _constant_rows(module: Any, names: Sequence[str]) -> list[list[str]]:
    return [
        [f"`{value}`", f"`{name}`: {cell(comment)}"]
        for name, value, comment in int_constants(module, names)
    ]


def exit_codes(command: Command) -> list[int]:
    """The statuses a command exits with: 0, those its callback can reach with
    ``typer.Exit(N)`` (through functions of its own module), the error status, the
    internal error and Ctrl-C."""
    callback = inspect.unwrap(command.callback)
    found = _reachable_exits(callback)
    common = {0, ERROR, ckptvault.cli.INTERNAL_ERROR, _interrupt.INTERRUPTED}
    return sorted(common | found)


def _reachable_exits(callback: Callable[..., Any]) -> set[int]:
    module = sys.modules[callback.__module__]
    functions = {
        node.name: node
        for node in ast.parse(inspect.getsource(module)).body
        if isinstance(node, ast.FunctionDef)
    }
    codes: set[int] = set()
    seen: set[str] = set()
    todo = [callback.__name__]
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Call):
                called = (
                    node.func.attr
                    if isinstance(node.func, ast.Attribute)
                    else getattr(node.func, "id", "")
                )
                code = node.args[0] if node.args else None
                if (
                    called == "Exit"
                    and isinstance(code, ast.Constant)
                    and isinstance(code.value, int)
                ):
                    codes.add(code.value)
                todo.append(called)
    return codes
