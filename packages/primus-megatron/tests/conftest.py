"""Fixtures of the megatron backend tests (helpers live in megatron_helpers, a unique module name)."""

from megatron_helpers import dp2_straight, reference  # noqa: F401  (session fixtures)
