"""Fixtures of the megatron backend tests (helpers live in megatron_helpers, a unique module name)."""

from megatron_helpers import bf16_run, dp2_straight, reference  # noqa: F401  (session fixtures)

from primus.megatron.dist import OPTIONAL_KERNEL_WARNINGS


def pytest_configure(config):
    # megatron's missing-TE / apex warnings, ignored as a run ignores them (pytest resets filters around each test)
    for pattern in OPTIONAL_KERNEL_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:.*{pattern}.*")
