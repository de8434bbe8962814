"""The ``ckptvault`` command: one module per command group.

Errors print a one-line reason on stderr (exit status 2), never a traceback;
``verify`` exits 1 when something it checked does not verify.
"""

from __future__ import annotations

import sys

import click
import typer

from ckptvault.cli import audit, keys
from ckptvault.cli.export import export, verify_export
from ckptvault.cli.inspect import inspect
from ckptvault.cli.ls import ls
from ckptvault.cli.verify import verify
from ckptvault.errors import CheckpointError

app = typer.Typer(
    name="ckptvault",
    help="Fast, crash-proof, verifiable PyTorch training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("ls")(ls)
app.command("inspect")(inspect)
app.command("verify")(verify)
app.command("export")(export)
app.command("verify-export")(verify_export)
app.add_typer(keys.app, name="keys")
app.add_typer(audit.app, name="audit")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns (and, as a script, exits with) the status code."""
    try:
        result = app(args=argv, standalone_mode=False)
    except click.exceptions.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except (CheckpointError, OSError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        print(f"ckptvault: error: {reason}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def run() -> None:
    sys.exit(main())
