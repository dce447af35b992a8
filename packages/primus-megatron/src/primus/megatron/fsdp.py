"""FSDP2 under Megatron-Core: megatron-core 0.16's ``TorchFullyShardedDataParallel`` (PyTorch ``fully_shard`` over the
data-parallel group; what AMD Primus calls ``use_torch_fsdp2``), for ``parallel.fsdp: true`` with dp_shard > 1.

Parameters, gradients and optimizer state are sharded over the data-parallel ranks: the parameters are DTensors
after wrapping, FSDP2 all-gathers each transformer layer just in time and reduce-scatters its gradients during the
backward, and megatron's regular (not distributed) optimizer steps each rank's shards. Its grad norm sums the squared
local shards over the data-parallel group once (``get_grad_norm_fp32`` finds the DTensors' mesh), then over the model-
parallel group, as for DDP.

:class:`FSDP2` adds what megatron-core 0.16's wrapper lacks for this backend (each a method of the subclass, listed in
:data:`primus.megatron.compat.PATCHES`): ``finish_grad_sync`` taking the ``force_all_reduce`` that 0.16's
``finalize_model_grads`` passes, and ``scale_gradients`` (a no-op in the base class) for the per-token loss of
fine-tuning, whose gradients are summed over data-parallel ranks and divided by the global token count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import TorchFullyShardedDataParallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# The modules FSDP2 gathers one at a time: megatron's default set without ColumnParallelLinear, which it keeps for
# Transformer Engine layers only. This backend's linears are ColumnParallelLinear inside each TransformerLayer, and a
# second fully_shard over them fails; the output layer joins the root unit.
UNITS = frozenset({TransformerLayer, LanguageModelEmbedding, RotaryEmbedding})


def _local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


def optimizer_param_ids() -> None:
    """megatron's optimizer checkpoint matches each optimizer parameter to the model's sharded tensor by identity:
    ``id(to_local_if_dtensor(param))`` against ``id(sharded_tensor.data)``, the DTensor's ``_local_tensor``. Since
    torch 2.13, ``DTensor.to_local()`` of a parameter returns a fresh view (to mark it a parameter), so nothing
    matches and saving fails ("Param id 0 does not match any model sharded param"). Match on ``_local_tensor``."""
    from megatron.core.dist_checkpointing import optimizer as optim_ckpt

    def get_optim_param_to_id_map(optim_params_iter: Any) -> dict[int, int]:
        ids: dict[int, int] = {}
        for i, param in enumerate(optim_params_iter):
            ids.setdefault(id(_local(param)), i)
        return ids

    optim_ckpt.get_optim_param_to_id_map = get_optim_param_to_id_map


class FSDP2(TorchFullyShardedDataParallel):
    def __init__(self, config: Any, ddp_config: Any, module: torch.nn.Module, per_token_loss: bool) -> None:
        super().__init__(config, ddp_config, module, sub_modules_to_wrap=set(UNITS))
        optimizer_param_ids()
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                if dist.get_backend() == "gloo":  # gloo has no AVG / PREMUL_SUM reduce-scatter: sum, then divide
                    m.set_force_sum_reduction_for_comms(True)
                if per_token_loss:  # summed over data-parallel ranks; megatron divides by the global token count
                    m.set_gradient_divide_factor(1.0)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """FSDP2 reduce-scattered every gradient during the backward. megatron's bf16 optimizer takes an fp32
        parameter's gradient (LoRA's adapters in a bf16 model, :mod:`primus.megatron.lora`) from ``main_grad``."""
        if self.config.bf16 or self.config.fp16:
            for p in self.module.parameters():
                if p.requires_grad and p.dtype == torch.float32:
                    p.main_grad = p.grad

    def scale_gradients(self, scaling_factor: float) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(scaling_factor)


def optimizer_state_as_dtensors(optimizer: Any) -> None:
    """After a checkpoint load, the optimizer's state of each FSDP2-sharded parameter as a DTensor like the
    parameter. megatron's checkpoint loads each rank's shard of exp_avg / exp_avg_sq, and torch's
    ``Optimizer.load_state_dict`` leaves it a plain tensor, which Adam cannot combine with the DTensor parameter."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for param, state in inner.state.items():
            if not isinstance(param, DTensor):
                continue
            for name, value in state.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == _local(param).shape:
                    state[name] = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
