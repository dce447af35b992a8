"""What the ``primus`` command modules share: the output consoles, common argument types, logging setup, the
error exit and config resolution. :mod:`primus.core.cli.app` and every ``cli_*`` module import it (never
``primus.core.cli.app`` itself, which imports them). Importing it imports neither torch nor an engine."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer
from rich.console import Console

from primus.core.config.errors import ConfigError

# Wide enough for the preset tables when output is piped (rich assumes 80 columns then).
out = Console(width=None if sys.stdout.isatty() else 320)  # piped: wide, so a row is never cut
# piped (a log file, a test, Slurm): wide as well, so one event stays one line (rich wraps at 80 columns otherwise)
err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 320)

Overrides = Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides, applied last")]
WorldSize = Annotated[
    int | None, typer.Option("--world-size", min=1, help="devices the run will use (default: $WORLD_SIZE or 1)")
]


def setup_logging(level: str = "info") -> None:
    from rich.logging import RichHandler

    rank = os.environ.get("RANK", "0")
    prefix = f"[rank{rank}] " if os.environ.get("WORLD_SIZE") else ""
    if err.is_terminal:
        handler: logging.Handler = RichHandler(console=err, show_path=False, show_time=False)
        handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    else:  # piped: one plain line a record (RichHandler pads and wraps every line to the console's width)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)-8s " + prefix + "%(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def fail(exc: Exception, code: int = 2) -> typer.Exit:
    err.print(f"error: {exc}", style="red", highlight=False, markup=False)
    return typer.Exit(code)


def resolve_or_exit(
    config: str | None, overrides: list[str] | None, world_size: int | None, check_plugins: bool = True
):
    from primus.core.launch.resolve import resolve

    try:
        return resolve(config, overrides or [], world_size, check_plugins=check_plugins)
    except ConfigError as exc:
        raise fail(exc) from None
