"""The FP8 recipe is core's (:mod:`primus.core.kernels.fp8_recipe`): the engines read it without importing turbo."""

from primus.core.kernels.fp8_recipe import FP8_MAX, GEMM_ALIGN, Fp8Recipe, config_issues, delayed_rowwise_reason

__all__ = ["FP8_MAX", "GEMM_ALIGN", "Fp8Recipe", "config_issues", "delayed_rowwise_reason"]
