"""The `qfd` command line: thin Typer wrappers over `qfd.stages`.

Each command module in `qfd/commands/` registers its commands here. Command modules must not
import torch or transformers at module level, so `qfd --help` answers instantly; the stage
code they call imports what it needs.
"""

from __future__ import annotations

import sys

import click
import typer

from qfd.errors import QfdError

try:  # typer >= 0.2x runs a vendored click (typer._click) whose exceptions click's classes miss
    from typer._click import exceptions as _vendored_click
except ImportError:
    _vendored_click = None
# Usage errors (missing or unknown options, bad values) from whichever click parsed the line
USAGE_ERRORS = tuple({click.ClickException, getattr(_vendored_click, "ClickException", click.ClickException)})
EXITS = tuple({click.exceptions.Exit, typer.Exit})
ABORTS = tuple({click.exceptions.Abort, typer.Abort})

app = typer.Typer(
    name="qfd",
    help="Quantize the target, quantize the drafter: an INT4 target recovered by QAD, a DFlash "
    "drafter (2-stage, GPTQ INT4, sliding window), lossless speculative serving and evaluation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
draft_app = typer.Typer(help="DFlash drafter: generate data, train (stage 1|2), quantize, sliding window, draft vocabulary.", no_args_is_help=True)
export_app = typer.Typer(help="Export a target + drafter for other engines (vLLM).", no_args_is_help=True)
app.add_typer(draft_app, name="draft")
app.add_typer(export_app, name="export")

SUBAPPS = {"draft": draft_app, "export": export_app}
# Command modules in the order their commands appear in --help.
COMMAND_MODULES = ("info", "generate", "quant", "draft", "draft_quant", "serve", "eval", "all", "export")


def _register_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"qfd.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"qfd.commands.{name}":
                continue  # not written yet
            raise
        module.register(app, SUBAPPS)


_register_commands()


# Import-time noise of optional dependencies that says nothing about the user's run: torchao
# (pulled in by gptqmodel/transformers) logs every prebuilt kernel that does not match this
# torch, and torch's pytree logger a deprecation for torchao's enums.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def _quiet_dependency_logs() -> None:
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one red line and exit code 2, never a traceback."""
    from qfd.console import console

    _quiet_dependency_logs()
    try:
        app(args=argv, standalone_mode=False)
    except QfdError as exc:
        console.print(f"[bold red]error:[/bold red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except EXITS as exc:
        sys.exit(exc.exit_code)
    except ABORTS:
        console.print("[bold red]aborted[/bold red]")
        sys.exit(130)
    except USAGE_ERRORS as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/bold red]: re-run the same command to resume")
        sys.exit(130)
