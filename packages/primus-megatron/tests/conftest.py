"""Fixtures of the megatron backend tests (helpers live in megatron_helpers, a unique module name)."""

from megatron_helpers import reference  # noqa: F401  (session fixture)
