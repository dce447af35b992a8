"""``primus data ...``: data preparation commands (mounted by :mod:`primus.core.cli.app`).

Importing this module imports neither numpy nor tokenizers: the work is imported when a command runs.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

data_app = typer.Typer(help="Prepare training data.", no_args_is_help=True)
_out = Console()
_err = Console(stderr=True)


@data_app.callback()
def _group() -> None:
    """Prepare training data."""  # a callback keeps `prepare` a subcommand even while it is the only one


@data_app.command()
def prepare(
    inputs: Annotated[list[str], typer.Argument(help=".jsonl/.txt/.parquet files, folders or globs")],
    output: Annotated[str, typer.Option("--output", "-o", help="output prefix: writes PREFIX.bin and PREFIX.idx")],
    tokenizer: Annotated[str, typer.Option(help="'bundled', a folder with tokenizer.json, or its path")] = "bundled",
    text_key: Annotated[str, typer.Option(help="field / column holding the text (.jsonl, .parquet)")] = "text",
    append_eos: Annotated[bool, typer.Option("--append-eos/--no-append-eos", help="end each document with EOS")] = True,
) -> None:
    """Tokenize text files into a Megatron indexed dataset (.bin/.idx), one sequence per document."""
    from primus.core.data.errors import DataError
    from primus.core.data.prepare import prepare as run_prepare

    try:
        result = run_prepare(inputs, tokenizer=tokenizer, output=output, text_key=text_key, append_eos=append_eos)
    except DataError as exc:
        _err.print(f"error: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    _out.print(
        f"wrote {result.prefix}.bin/.idx: {result.documents:,} documents, {result.tokens:,} tokens "
        f"({result.dtype}, {result.writer} writer)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
