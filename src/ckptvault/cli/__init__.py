"""The ``ckptvault`` command: one module per command group.

Errors print a one-line reason on stderr, never a traceback, naming the commands'
flags rather than the library's arguments (:mod:`ckptvault.cli._wording`): exit
status 2 for a ckptvault or OS error, for usage errors and for errors of the AWS SDK
(credentials, region, endpoint), 3 for an unexpected internal error (a bug: the
message asks for a report); ``verify`` exits 1 when something it checked does not
verify.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import Callable
from inspect import cleandoc
from typing import Annotated, Any

import typer

from ckptvault.cli import audit, keys
from ckptvault.cli._common import safe_text
from ckptvault.cli._interrupt import Interrupted, interrupted
from ckptvault.cli._wording import cli_wording
from ckptvault.cli.catalog import catalog
from ckptvault.cli.consolidate import consolidate
from ckptvault.cli.doctor import doctor
from ckptvault.cli.drill import drill
from ckptvault.cli.export import export, verify_export
from ckptvault.cli.gc import gc
from ckptvault.cli.inspect import inspect
from ckptvault.cli.ls import ls
from ckptvault.cli.plan import plan
from ckptvault.cli.sign import sign
from ckptvault.cli.status import status
from ckptvault.cli.supervise import supervise
from ckptvault.cli.validate import validate
from ckptvault.cli.verify import verify
from ckptvault.errors import CheckpointError

INTERNAL_ERROR = 3  # exit status for an unexpected exception: a bug in ckptvault

app = typer.Typer(
    name="ckptvault",
    help="Fast, crash-proof, verifiable PyTorch training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from ckptvault._version import __version__

        print(f"ckptvault {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print the version; exit."
        ),
    ] = False,
) -> None:
    """Fast, crash-proof, verifiable PyTorch training checkpoints."""


app.command("ls")(ls)
app.command("inspect")(inspect)
app.command("catalog")(catalog)
app.command("verify")(verify)
app.command("validate")(validate)
app.command("export")(export)
app.command("verify-export")(verify_export)
app.command("consolidate")(consolidate)
app.command("sign")(sign)
app.command("gc")(gc)
app.command("doctor")(doctor)
app.command("drill")(drill)
app.command("plan")(plan)
app.command("status")(status)
app.command("supervise")(supervise)
app.add_typer(keys.app, name="keys")
app.add_typer(audit.app, name="audit")


def _interruptible(callback: Callable[..., Any]) -> Callable[..., Any]:
    """``callback`` with Ctrl-C raised as :class:`Interrupted`, past click's handler."""

    @functools.wraps(callback)  # typer reads the options from the wrapped signature
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted from None

    return command


def reflowed(doc: str) -> str:
    """A docstring as help text: each paragraph's lines joined into one, so that the
    terminal (or a pipe at 80 columns) wraps it, not the source's line breaks; a
    paragraph holding a list or indented lines is kept as written."""
    paragraphs = re.split(r"\n\s*\n", cleandoc(doc))
    return "\n\n".join(
        p if re.search(r"\n\s*([-*]|\d+[.)]|\s)", p) else " ".join(p.split()) for p in paragraphs
    )


for _typer in (app, keys.app, audit.app):
    for _info in _typer.registered_commands:
        if _info.callback is not None:
            if _info.help is None and _info.callback.__doc__:
                _info.help = reflowed(_info.callback.__doc__)
            _info.callback = _interruptible(_info.callback)


class _SafeLogText(logging.Filter):
    """Warnings quote the store (why a generation was skipped: key ids, run ids,
    names); on a terminal they are escaped like everything else the CLI prints."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = safe_text(record.getMessage())
        record.args = None
        return True


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns (and, as a script, exits with) the status code."""
    logger = logging.getLogger("ckptvault")
    log_filter = _SafeLogText()
    logger.addFilter(log_filter)
    try:
        return _main(argv)
    except (KeyboardInterrupt, Interrupted):
        return interrupted()  # one line, exit 130; temporary files went on the way out
    finally:
        logger.removeFilter(log_filter)


def _main(argv: list[str] | None) -> int:
    try:
        result = app(args=argv, standalone_mode=False)
    except (CheckpointError, OSError) as exc:
        # The library's errors name its arguments (keystore=): reworded to the flags.
        return _fail(cli_wording(_one_line(exc)) or type(exc).__name__, 2)
    except Exception as exc:
        if _is_cloud_error(exc):  # credentials, region, endpoint: the environment's, not a bug
            return _fail(f"{type(exc).__name__}: {_one_line(exc)}", 2)
        # Usage errors from click (typer may vendor its own copy): show one line.
        exit_code = getattr(exc, "exit_code", None)
        if not isinstance(exit_code, int) or not callable(getattr(exc, "format_message", None)):
            if type(exc).__name__ == "Abort":  # Ctrl-C at a prompt, or before a command ran
                return interrupted()
            return _fail(
                f"internal error: {type(exc).__name__}: {_one_line(exc)[:500]} "
                f"(ckptvault {_version()}; this is a bug, please report it with the command "
                "you ran)",
                INTERNAL_ERROR,
            )
        if type(exc).__name__ == "NoArgsIsHelpError":
            # A click exception, possibly from typer's vendored copy of click: duck-typed.
            exc.show()  # type: ignore[attr-defined]
            return 0
        message = exc.format_message()  # type: ignore[attr-defined]  # checked callable above
        return _fail(f"{message} (see --help)", exit_code)
    return result if isinstance(result, int) else 0


def _is_cloud_error(exc: BaseException) -> bool:
    """An error of the AWS SDK (no region, no credentials, an unreachable endpoint, a
    refused request) that reached the command without being translated."""
    return type(exc).__module__.split(".")[0] in ("botocore", "boto3")


def _one_line(exc: BaseException) -> str:
    """The error's message on one line; an OSError without its ``[Errno N]`` prefix
    (the message says what failed; the number tells a user nothing)."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror if exc.filename is None else f"{exc.strerror}: {exc.filename}"
    return " ".join(text.split())


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ckptvault")
    except Exception:
        return "unknown version"


def _fail(reason: str, code: int) -> int:
    # Error messages quote the store: one line, no control characters, on any terminal.
    print(f"ckptvault: error: {safe_text(reason)}", file=sys.stderr)
    return code


def run() -> None:
    """Exit with :func:`main`'s status; ``ckptvault.__main__.run`` (the console script)
    also catches a Ctrl-C during the imports before it."""
    sys.exit(main())
