"""Each torchtitan-0.2.2 adaptation in primus.torchtitan.compat, with a check that fails when the
engine changes under it (then the adaptation must be revisited)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch

from primus.torchtitan import compat


def test_pinned_version():
    assert version("torchtitan") == compat.TORCHTITAN_VERSION


def test_device_detection_still_falls_back_to_cuda():
    import torchtitan.tools.utils as tt_utils

    assert '_get_available_device_type() or "cuda"' in inspect.getsource(tt_utils.get_device_info)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU adaptation applies only without a GPU")
def test_cpu_device_reaches_every_module_that_copies_it():
    # a fresh interpreter: the choice is made once, at torchtitan's first import
    code = (
        "from primus.torchtitan import compat; assert compat.import_torchtitan('cpu') == 'cpu'\n"
        "import torchtitan.components.metrics as m, torchtitan.distributed.utils as d, "
        "torchtitan.distributed.parallel_dims as p, torchtitan.tools.profiling as pr\n"
        "assert m.device_type == d.device_type == p.device_type == 'cpu'\n"
        "assert isinstance(m.device_module, compat.CpuDeviceModule) and pr.device_module is m.device_module\n"
        "mon = m.DeviceMemoryMonitor('cpu:0'); assert mon.get_peak_stats().max_reserved_gib > 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_moe_kernels_still_import_triton():
    import importlib.util

    spec = importlib.util.find_spec("torchtitan.models.moe")
    source = open(spec.submodule_search_locations[0] + "/kernels.py").read()
    assert "import triton" in source
    assert all(f"def {name}" in source for name in ("generate_permute_indices", "fill_indices_wrapper"))
    if importlib.util.find_spec("triton") is None:
        standin = sys.modules["torchtitan.models.moe.kernels"]
        with pytest.raises(RuntimeError, match="needs triton"):
            standin.generate_permute_indices()


def test_fsdp_without_divide_factor_uses_premul_sum_unless_forced():
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    from torchtitan.models.llama3.infra import parallelize

    # torchtitan sets the divide factor to 1 ...
    assert "set_gradient_divide_factor(1.0)" in inspect.getsource(parallelize.disable_fsdp_gradient_division)

    class Group:
        def size(self):
            return 2

    # ... which torch turns into PREMUL_SUM (gloo has none) unless sum reduction is forced
    _, _, op, _ = _get_gradient_divide_factors(Group(), None, torch.float32, "cpu", 1.0)
    assert op != ReduceOp.SUM and op != ReduceOp.AVG  # a PREMUL_SUM(1.0) op object
    pre, post, op, _ = _get_gradient_divide_factors(Group(), None, torch.float32, "cpu", 1.0, True)
    assert op == ReduceOp.SUM and post == 1.0 and pre is None


def test_pipeline_still_backpropagates_the_summed_loss():
    from torchtitan.distributed import pipeline_parallel

    assert "scale_grads=False" in inspect.getsource(pipeline_parallel.build_pipeline_schedule)
    assert compat.pp_grad_scale(128) == pytest.approx(1 / 128)


def test_ddp_still_averages_over_replicas():
    from torchtitan.models.llama3.infra import parallelize

    src = inspect.getsource(parallelize.apply_ddp)
    assert "replicate(model" in src  # composable DDP: averages gradients (no divide-factor hook)
    assert compat.ddp_grad_scale(2) == 2.0


def test_job_config_fields_primus_sets_exist():
    fields = compat.job_config_fields()
    for section, names in {
        "training": {
            "local_batch_size",
            "global_batch_size",
            "seq_len",
            "steps",
            "max_norm",
            "dtype",
            "mixed_precision_param",
            "mixed_precision_reduce",
        },
        "parallelism": {
            "data_parallel_replicate_degree",
            "data_parallel_shard_degree",
            "fsdp_reshard_after_forward",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "pipeline_parallel_schedule",
            "pipeline_parallel_microbatch_size",
            "module_fqns_per_model_part",
            "context_parallel_degree",
        },
        "checkpoint": {
            "enable",
            "folder",
            "interval",
            "keep_latest_k",
            "last_save_model_only",
            "initial_load_path",
            "load_only",
            "create_seed_checkpoint",
        },
        "lr_scheduler": {"warmup_steps", "decay_type", "decay_ratio", "min_lr_factor", "total_steps"},
        "optimizer": {"name", "lr", "eps", "weight_decay", "beta1", "beta2", "implementation"},
        "activation_checkpoint": {"mode", "selective_ac_option"},
    }.items():
        assert names <= fields[section], names - fields[section]


def test_pipeline_schedules_exist():
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in compat.PP_SCHEDULES.values():
        assert get_schedule_class(name) is not None


def test_stage_split():
    assert compat.llama3_fqns_per_stage(2, 2) == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    assert compat.llama3_fqns_per_stage(4, 5)[0] == ["tok_embeddings", "layers.0", "layers.1"]


def test_apply_overrides_nested_and_dotted():
    jc = compat.new_job_config()
    compat.apply_overrides(jc, {"checkpoint": {"folder": "x"}, "training.gc_freq": 7})
    assert jc.checkpoint.folder == "x" and jc.training.gc_freq == 7
    with pytest.raises(KeyError, match="no field"):
        compat.apply_overrides(jc, {"checkpoint": {"nope": 1}})


def test_extra_value_nested_or_dotted():
    assert compat.extra_value({"checkpoint": {"create_seed_checkpoint": True}}, "checkpoint.create_seed_checkpoint")
    assert compat.extra_value({"checkpoint.create_seed_checkpoint": True}, "checkpoint.create_seed_checkpoint")
    assert compat.extra_value({}, "checkpoint.create_seed_checkpoint", False) is False


def test_last_save_still_skips_the_purge():
    from torchtitan.components.checkpoint import CheckpointManager

    src = inspect.getsource(CheckpointManager.save)
    last = src.index("if last_step:")
    assert "return" in src[last : last + 120] and "_purge_stale_checkpoints()" in src[last:]
    assert hasattr(CheckpointManager, "_purge_stale_checkpoints")


def test_train_step_still_clips_then_steps_the_optimizer_and_schedule():
    """grad_norm_recorder (health checks before the update) relies on this order in one method."""
    from torchtitan.train import Trainer

    src = inspect.getsource(Trainer.train_step)
    clip, opt, lr = (
        src.index(s) for s in ("dist_utils.clip_grad_norm_(", "self.optimizers.step()", "self.lr_schedulers.step()")
    )
    assert clip < opt < lr
    assert "from torchtitan.distributed import ParallelDims, utils as dist_utils" in inspect.getsource(
        sys.modules["torchtitan.train"]
    )
    seen = []
    with compat.grad_norm_recorder(seen.append):
        import torchtitan.distributed.utils as dist_utils

        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 2.0)
        norm = dist_utils.clip_grad_norm_([p], float("inf"))
    assert seen == [norm] and norm.item() == pytest.approx(4.0)
    assert dist_utils.clip_grad_norm_.__module__ == "torchtitan.distributed.utils"  # restored


def test_ops_the_kernel_swap_retypes_are_still_torchtitans():
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper
    from torchtitan.models.llama3.model import model as llama3
    from torchtitan.models.qwen3.model import model as qwen3

    for mod in (llama3, qwen3):
        assert "F.silu(self.w1(x)) * self.w3(x)" in inspect.getsource(mod.FeedForward.forward)
        assert "nn.RMSNorm(" in inspect.getsource(mod.TransformerBlock.__init__)
        assert "ScaledDotProductAttentionWrapper()" in inspect.getsource(mod.Attention.__init__)
    params = inspect.signature(ScaledDotProductAttentionWrapper.forward).parameters
    assert list(params) == ["self", "q", "k", "v", "scale", "enable_gqa", "is_causal"]
    assert "view_as_complex" in inspect.getsource(llama3.apply_rotary_emb)  # interleaved RoPE: not swapped
