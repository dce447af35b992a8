"""Triton kernels (one source for CUDA and ROCm), each a ``torch.autograd.Function`` with a Triton
forward and backward, behind functions with core's op contracts (:mod:`primus.core.kernels.selection`).

Importing a submodule imports ``triton``; this package itself imports nothing heavy.
"""
