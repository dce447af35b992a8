"""Kernels: one provider per op for the device (:mod:`~primus.core.kernels.selection`), the ops' call contracts
(:mod:`~primus.core.kernels.contracts`), plain-PyTorch references, FP8 recipes and the linear shapes FP8 weighs."""
