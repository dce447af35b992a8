"""The one error type the data layer raises for bad inputs: it always names the file or setting at fault."""

from __future__ import annotations

from primus.core.contracts.errors import UserError


class DataError(UserError, ValueError):
    """A data source, tokenizer or indexed dataset that cannot be used as given."""
