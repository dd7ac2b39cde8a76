"""One rich console for humans (stderr keeps stdout clean for streamed tokens and JSON)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(stderr=True)
stdout = Console()


@contextmanager
def progress_bar(transient: bool = False) -> Iterator[Progress]:
    """A progress bar for long loops. Use `task = p.add_task("what", total=n)` and
    `p.update(task, advance=1, postfix="kl=0.12")`: the `postfix` field is shown after the bar."""
    columns = (
        TextColumn("[bold blue]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[postfix]}"),
    )
    with Progress(*columns, console=console, transient=transient) as progress:
        original_add_task = progress.add_task

        def add_task(description: str, *args, **kwargs):
            kwargs.setdefault("postfix", "")
            return original_add_task(description, *args, **kwargs)

        progress.add_task = add_task  # type: ignore[method-assign]
        yield progress
