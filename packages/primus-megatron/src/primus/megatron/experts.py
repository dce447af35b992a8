"""Megatron's routed experts as grouped GEMMs over stacked weights: :class:`StackedExperts`.

megatron-core (0.16, 0.19) runs a layer's local experts either as ``SequentialMLP`` (a loop of small MLPs, each expert's
``linear_fc1`` / ``linear_fc2`` its own parameters) or as ``GroupedMLP`` / ``TEGroupedMLP``, which need the
``grouped_gemm`` package or Transformer Engine (neither runs on ROCm's nor CPU's torch without them).

:class:`StackedExperts` holds the local experts' weights as two parameters, ``weight1`` ``[experts, 2·ffn/tp, h]``
(each expert's ``[gate; up]`` rows, as SequentialMLP's ``linear_fc1.weight``) and ``weight2`` ``[experts, h, ffn/tp]``,
and runs the ``grouped_gemm`` provider twice with the ``swiglu`` provider between them, for all experts at once. One
parameter per weight kind instead of one per expert is what makes it fast: a stack of per-expert parameters copies
every weight each step and makes the distributed optimizer and the gradient buffers work per expert (on the H200, a
Qwen3-30B-A3B-shaped layer's 128 experts: 3,162 small gradient-add kernels a step, 29% of kernel time — see
benchmarks/results/moe_h200_profiled.json).

Checkpoints keep SequentialMLP's format: the sharded state dict splits each stacked parameter into one tensor per
expert under SequentialMLP's keys, offsets and SwiGLU halves (a ``ShardedTensorFactory`` over the parameter itself,
so the regular optimizer's state follows it), so a checkpoint's *weights* load into either class (seed checkpoints,
``train.init_from``, ``primus eval``, Hugging Face export all read it). The *optimizer* state does not carry over
between the two (one tensor per weight kind vs one per expert): the checkpoint records which one wrote it
(:data:`STACKED` / :data:`PER_EXPERT`, ``primus.megatron.layer_spec.experts_layout``) and a resume under the other is
refused before anything is read.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from primus.core.contracts.protocols import load_ref
from primus.core.kernels import reference

STACKED, PER_EXPERT = "stacked", "per_expert"


def experts_apart(config: Any) -> bool:
    """Whether the routed experts' data-parallel group is not the dense one: under EP, and under TP too, where each
    tensor-parallel rank holds every local expert whole (expert_tensor_parallel_size 1, as dist.init_parallel builds
    the groups) and routes only its sequence-parallel share of the tokens."""
    return config.expert_model_parallel_size > 1 or config.tensor_model_parallel_size > 1


class StackedExperts(MegatronModule):
    # (``name``: megatron-core 0.19's MoE layer names its experts for its own logging; unused here)
    def __init__(self, num_local_experts: int, config: Any, submodules: Any = None, pg_collection: Any = None,
                 name: str | None = None, *, gemm: Any = "", swiglu: Any = ""):  # fmt: skip
        from megatron.core.tensor_parallel.layers import (
            _initialize_affine_weight_gpu,
            set_tensor_model_parallel_attributes,
        )
        from megatron.core.utils import divide

        super().__init__(config=config)
        if not config.gated_linear_unit or config.add_bias_linear:
            raise ValueError("StackedExperts: SwiGLU experts without biases only (model.moe is built that way)")
        self.gemm, self.swiglu = load_ref(gemm), load_ref(swiglu)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        ffn, h = divide(config.moe_ffn_hidden_size, self.tp_group.size()), config.hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        shape = {"weight1": (num_local_experts, 2 * ffn, h), "weight2": (num_local_experts, h, ffn)}
        init = {"weight1": config.init_method, "weight2": config.output_layer_init_method}
        for name, tp_dim in (("weight1", 1), ("weight2", 2)):  # the tensor-parallel dim of each expert's matrix
            w = torch.nn.Parameter(torch.empty(shape[name], dtype=config.params_dtype, device=device))
            if config.perform_initialization:  # megatron's init of expert weights (expert-parallel RNG stream)
                _initialize_affine_weight_gpu(w, init[name], partition_dim=tp_dim, is_expert=True)
            else:
                set_tensor_model_parallel_attributes(w, True, tp_dim, 1)
            # reduced over the experts' data-parallel group where it is not the dense one (under EP or TP)
            w.allreduce = not experts_apart(config)
            setattr(self, name, w)
        self.register_load_state_dict_post_hook(_ignore_extra_states)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:  # fmt: skip
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # megatron's: top-1 routing scales the input instead
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), torch.ones_like(probs)
        if x.shape[0] == 0:
            # no token for this rank's experts (expert parallelism): an empty product still gives every weight its
            # (zero) gradient, which megatron's gradient buffers wait for
            gate, up = (x @ self.weight1[0].t()).chunk(2, dim=-1)
            return reference.swiglu(gate, up) @ self.weight2[0].t(), None
        # the dispatcher may hold the counts on the host (SequentialMLP reads them with .tolist())
        offs = torch.as_tensor(tokens_per_expert, device=x.device).cumsum(0, dtype=torch.int32)
        gate, up = self.gemm(x, self.weight1, offs).chunk(2, dim=-1)
        # megatron's MLP: the routing probability scales the activation, in the activation's dtype
        act = (self.swiglu(gate, up) * probs.unsqueeze(-1)).to(x.dtype)
        return self.gemm(act, self.weight2, offs), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """SequentialMLP's sharded tensors (``{prefix}experts.linear_fc{1,2}.weight``, the global expert a prepended
        axis, fc1's gate and up halves at their places among the tensor-parallel ranks' halves) built from the
        stacked parameters, and its (empty) extra states, so either class reads the other's checkpoint weights."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

        if (metadata or {}).get("singleton_local_shards"):
            raise NotImplementedError("StackedExperts: megatron's singleton_local_shards checkpoint format")
        experts, first = self.num_local_experts, self.ep_group.rank() * self.num_local_experts
        total = self.ep_group.size() * experts
        tp, t, d = self.tp_group.size(), self.tp_group.rank(), self.dp_group.rank()
        replica = (0, 0, d)  # tensor-parallel shards, replicated over the expert-data-parallel ranks
        offsets = [(*sharded_offsets, (len(sharded_offsets), first + i, total)) for i in range(experts)]
        axis = len(sharded_offsets) + 1  # the first axis of an expert's own matrix

        # megatron's apply_swiglu_sharded_factory places the halves so, but over a per-expert tensor: a factory whose
        # data is not the parameter itself would lose the regular optimizer's state (mapped by parameter identity)
        def build1(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> list:
            assert flattened_range is None, "StackedExperts: flattened optimizer state"
            out = []
            for i in range(experts):
                gate, up = data[i].chunk(2, dim=0)
                for half, piece in ((gate, t), (up, tp + t)):
                    out.append(
                        ShardedTensor.from_rank_offsets(
                            key, half, *offsets[i], (axis, piece, 2 * tp), replica_id=replica_id, prepend_axis_num=axis
                        )
                    )
            return out

        def build2(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> list:
            assert flattened_range is None, "StackedExperts: flattened optimizer state"
            return [ShardedTensor.from_rank_offsets(key, data[i], *offsets[i], (axis + 1, t, tp),
                                                    replica_id=replica_id, prepend_axis_num=axis)
                    for i in range(experts)]  # fmt: skip

        def merge1(loaded: list) -> torch.Tensor:
            return torch.stack([torch.cat(loaded[2 * i : 2 * i + 2]) for i in range(experts)])

        sd: dict[str, Any] = {
            f"{prefix}weight1": ShardedTensorFactory(
                f"{prefix}experts.linear_fc1.weight", self.weight1, build1, merge1, replica
            ),
            f"{prefix}weight2": ShardedTensorFactory(
                f"{prefix}experts.linear_fc2.weight", self.weight2, build2, torch.stack, replica
            ),
        }
        for i in range(experts):  # SequentialMLP's linears hold an (empty) extra state each
            for mod in ("linear_fc1", "linear_fc2"):
                sd[f"{prefix}expert{first + i}.{mod}._extra_state"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{mod}._extra_state", offsets[i], (0, t, d)
                )
        return sd


def _ignore_extra_states(module: torch.nn.Module, incompatible: Any) -> None:
    """SequentialMLP's extra states (in a checkpoint's model state) have no place here: drop them, not fail."""
    for key in [k for k in incompatible.unexpected_keys if k.endswith("_extra_state")]:
        incompatible.unexpected_keys.remove(key)
