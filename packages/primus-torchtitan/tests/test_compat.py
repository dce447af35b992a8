"""Each torchtitan-0.2.2 patch and override listed in primus.torchtitan.compat.PATCHES, with a check that
fails when the engine changes under it (then the patch must be revisited)."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import warnings
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from primus.torchtitan import compat


def _params(fn):
    """(name, kind, default) of each parameter: what a caller relies on (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_patch_table_names_a_test_for_every_patch():
    """Every patch names its tests; every function / class compat defines is a patch, the version check or the
    CPU import."""
    from primus.core.contracts.patches import table_problems

    assert table_problems(compat, Path(__file__).parent, exempt=("check_version", "import_torchtitan")) == []


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


def test_every_module_selects_the_device_before_importing_torchtitan():
    # whichever of our modules a process imports first must not let torchtitan pick "cuda" on a CPU build
    # (primus.torchtitan.deepseek imported torchtitan directly: every later import in that process refused)
    late = []
    for path in sorted(Path(compat.__file__).parent.glob("*.py")):
        selected = path.stem == "compat"
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Expr) and "compat.import_torchtitan" in ast.unparse(node):
                selected = True
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if not selected and any(n.split(".")[0] == "torchtitan" for n in names):
                late.append(f"{path.name}:{node.lineno}")
    assert late == []


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


def test_hf_datasets_builders_are_all_torchtitan_imports():
    """Every name torchtitan's own modules (its experiments aside) import from its HF text datasets is one the
    stand-in forwards, and a function of the real module; the module still imports Hugging Face datasets (else the
    stand-in is not needed)."""
    root = Path(importlib.util.find_spec("torchtitan").submodule_search_locations[0])
    imported = set()
    for path in root.rglob("*.py"):
        if "experiments" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == compat.HF_DATASETS:
                imported |= {alias.name for alias in node.names}
    assert imported == set(compat.HF_DATASETS_NAMES)
    source = (root / "hf_datasets" / "text_datasets.py").read_text()
    assert "from datasets import" in source
    assert all(f"def {name}(" in source for name in compat.HF_DATASETS_NAMES)


def test_a_rank_imports_no_hf_datasets():
    """After Primus's import of torchtitan (its trainer and models) no Hugging Face datasets, pandas or pyarrow is
    loaded; a builder called, or any other name of the module read, imports the real one."""
    code = (
        "import sys; from primus.torchtitan import compat; compat.import_torchtitan(); import torchtitan.train; "
        "import torchtitan.models.llama3, torchtitan.models.qwen3, torchtitan.models.deepseek_v3; "
        "print(sorted(m for m in ('datasets', 'pandas', 'pyarrow') if m in sys.modules)); "
        f"m = sys.modules[{compat.HF_DATASETS!r}]; print(m.build_text_dataloader.__name__, hasattr(m, '__file__')); "
        "m.HuggingFaceTextDataset; print('datasets' in sys.modules, sys.modules[m.__name__] is not m)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:3] == ["[]", "build_text_dataloader False", "True True"], out


def test_moe_router_still_counts_integer_indices_with_histc():
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    assert "torch.histc(" in inspect.getsource(TokenChoiceTopKRouter.forward)
    indices = torch.tensor([3, 0, 3, 1, 7, 3])
    assert getattr(torch.histc, "_primus_integer", False)  # applied by the CPU import
    counts = torch.histc(indices, bins=8, min=0, max=8)
    assert counts.dtype == torch.int64 and counts.tolist() == torch.bincount(indices, minlength=8).tolist()
    assert torch.histc(torch.tensor([0.5, 1.5]), bins=2, min=0, max=2).tolist() == [1.0, 1.0]
    unpatched = torch.histc.__closure__[0].cell_contents
    with pytest.raises(NotImplementedError):  # torch's CPU kernel still takes no integers: the patch is needed
        unpatched(indices, bins=8, min=0, max=8)


def test_moe_permute_still_has_a_cpu_path():
    from torchtitan.models.moe import kernels
    from torchtitan.models.moe import utils as moe_utils

    assert "use_cpu" in inspect.signature(kernels.generate_permute_indices).parameters
    assert "generate_permute_indices(" in inspect.getsource(moe_utils._permute)
    assert moe_utils.generate_permute_indices.keywords == {"use_cpu": True}  # applied by the CPU import


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
    # PrimusTrainer wraps the containers' step per instance (a skipped update): both are called by attribute
    from torchtitan.components.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer import OptimizersContainer

    assert callable(OptimizersContainer.step) and callable(LRSchedulersContainer.step)
    # set_lr and exempt_from_weight_decay reach the torch optimizers by iterating the container
    assert "return iter(self.optimizers)" in inspect.getsource(OptimizersContainer.__iter__)
    from primus.torchtitan.trainer import exempt_from_weight_decay

    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    adam = torch.optim.AdamW([w, b], lr=1.0, weight_decay=0.1)
    exempt_from_weight_decay([adam])
    assert [(g["params"], g["weight_decay"]) for g in adam.param_groups] == [([w], 0.1), ([b], 0.0)]
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
    # loss.fuse_output: the model's forward calls its output module on the final hidden states, the trainer hands
    # that result to the loss function (which a fused head's loss-sum passes through)
    for model_cls in (llama3.Transformer, qwen3.Qwen3Model):
        assert "output = self.output(h) if self.output is not None else h" in inspect.getsource(model_cls.forward)
        assert "self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)" in inspect.getsource(
            model_cls.__init__
        )
    from torchtitan.train import Trainer

    assert "loss_sum = self.loss_fn(pred, labels)" in inspect.getsource(Trainer.forward_backward_step)


def test_tied_embedding_fully_shard_patch(monkeypatch):
    """compat.tied_embedding_fsdp_group replaces the module-level name ``fully_shard`` that llama3's ``apply_fsdp``
    looks up at call time: run torchtitan's own apply_fsdp under it (fully_shard recorded, no process group) and
    the embedding joins the output head's group, tied again."""
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize
    from torch.distributed.fsdp import fully_shard

    assert llama3_parallelize.fully_shard is fully_shard
    assert "fully_shard" in llama3_parallelize.apply_fsdp.__code__.co_names  # a global lookup: the patch reaches it
    assert list(inspect.signature(llama3_parallelize.apply_fsdp).parameters)[:5] == [
        "model",
        "dp_mesh",
        "param_dtype",
        "reduce_dtype",
        "pp_enabled",
    ]

    groups = []

    def recorder(module, **kwargs):
        groups.append(module)
        return module

    monkeypatch.setattr(llama3_parallelize, "fully_shard", recorder)
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(8, 4)
    model.layers = nn.ModuleDict({"0": nn.Linear(4, 4)})
    model.norm, model.output = nn.RMSNorm(4), nn.Linear(4, 8, bias=False)
    assert model.output.weight is not model.tok_embeddings.weight  # as tensor parallelism leaves them
    with compat.tied_embedding_fsdp_group(model):
        llama3_parallelize.apply_fsdp(model, None, torch.float32, torch.float32, pp_enabled=False)
    assert llama3_parallelize.fully_shard is recorder  # restored
    assert groups == [model.layers["0"], [model.tok_embeddings, model.norm, model.output], model]
    assert model.output.weight is model.tok_embeddings.weight


def test_register_train_spec_replaces_through_the_private_dict():
    """torchtitan's register_train_spec refuses a name twice; compat.register_train_spec pops it from the private
    ``_extra_train_specs`` first, which get_train_spec reads before its own registry."""
    import torchtitan.protocols.train_spec as ts

    assert isinstance(ts._extra_train_specs, dict)
    assert "_extra_train_specs[name]" in inspect.getsource(ts.get_train_spec)
    name, first, second = "primus_test_compat", object(), object()
    try:
        compat.register_train_spec(name, first)
        with pytest.raises(ValueError, match="already registered"):
            ts.register_train_spec(name, second)  # why the patch exists
        compat.register_train_spec(name, second)
        assert ts.get_train_spec(name) is second
    finally:
        ts._extra_train_specs.pop(name, None)


def test_trainer_overrides_keep_torchtitans_signatures():
    """PrimusTrainer's overrides take what torchtitan's Trainer passes them, and torchtitan still calls
    forward_backward_step (by keyword) once per micro-batch of a step and holds the attributes they read."""
    from torchtitan.train import Trainer

    from primus.torchtitan.trainer import PrimusTrainer

    for name in ("forward_backward_step", "train_step"):
        assert _params(getattr(PrimusTrainer, name)) == _params(getattr(Trainer, name)), name
    assert [p.name for p in inspect.signature(Trainer.forward_backward_step).parameters.values()][1:] == [
        "input_dict",
        "labels",
        "global_valid_tokens",
    ]
    step = inspect.getsource(Trainer.train_step)
    assert "for _microbatch in range(self.gradient_accumulation_steps):" in step
    call = step[step.index("self.forward_backward_step(") :]
    call = call[: call.index(")")]
    assert all(f"{kw}=" in call for kw in ("input_dict", "labels", "global_valid_tokens")), call
    assert step.index("self.forward_backward_step(") < step.index("dist_utils.clip_grad_norm_(")
    # what the engine does in place of Trainer.train: step number, GC, one train_step over the batch generator
    train = inspect.getsource(Trainer.train)
    for line in ("self.step += 1", "self.gc_handler.run(self.step)", "self.train_step(data_iterator)"):
        assert line in train, line
    assert "data_iterator = self.batch_generator(self.dataloader)" in train
    fields = Trainer.__annotations__
    for attr in ("parallel_dims", "model_parts", "optimizers", "lr_schedulers", "metrics_processor", "device"):
        assert attr in fields, attr
    for attr in ("gradient_accumulation_steps", "pp_has_last_stage", "step", "checkpointer"):
        assert attr in fields, attr


def test_maybe_enable_amp_is_an_attribute_built_once():
    """PrimusTrainer replaces the context manager Trainer.__init__ builds with nullcontext() for fp32 params: torchtitan
    must still build it once, as an attribute, and enter that attribute; without it torchtitan autocasts to float32."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.train import Trainer

    from primus.torchtitan.trainer import PrimusTrainer

    assert "self.maybe_enable_amp = dist_utils.maybe_enable_amp(" in inspect.getsource(Trainer.__init__)
    assert "with self.maybe_enable_amp:" in inspect.getsource(Trainer.forward_backward_step)
    assert "self.maybe_enable_amp = contextlib.nullcontext()" in inspect.getsource(PrimusTrainer.__init__)
    params = list(inspect.signature(dist_utils.maybe_enable_amp).parameters)
    assert params == ["parallel_dims", "mixed_precision_param", "device_type"]
    plain = SimpleNamespace(fsdp_enabled=False, tp_enabled=False, pp_enabled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that CPU autocast does not take float32: what the override avoids
        assert isinstance(dist_utils.maybe_enable_amp(plain, "float32", "cpu"), torch.autocast)


def test_metrics_processor_override_keeps_should_log():
    """SilentMetricsProcessor.should_log keeps torchtitan's train_step from logging (core's loop reports): the step
    returns before its loss reductions and log when should_log is false."""
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.train import Trainer

    from primus.torchtitan.metrics import SilentMetricsProcessor, metrics_builder

    assert _params(SilentMetricsProcessor.should_log) == _params(MetricsProcessor.should_log)
    step = inspect.getsource(Trainer.train_step)
    gate = step.index("if not self.metrics_processor.should_log(self.step):")
    assert step[gate:].split("\n")[1].strip() == "return"
    assert gate < step.index("self.metrics_processor.log(")
    assert list(inspect.signature(MetricsProcessor.__init__).parameters)[:3] == ["self", "job_config", "parallel_dims"]
    trainer = inspect.getsource(sys.modules["torchtitan.train"])
    assert "build_metrics_processor_fn(\n            job_config, parallel_dims, model_args\n        )" in trainer
    build = inspect.signature(metrics_builder())
    assert list(build.parameters)[:3] == ["job_config", "parallel_dims", "model_args"]


def test_dense_model_overrides_keep_signatures():
    """DenseTransformer overrides llama3's Transformer.__init__ and init_weights; torchtitan builds the model from its
    args and calls init_weights(buffer_device=...) after ``to_empty`` (which unties the weights: tied again there)."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    from primus.torchtitan.dense import DenseModelArgs, DenseTransformer

    assert _params(DenseTransformer.init_weights) == _params(Transformer.init_weights)
    assert _params(DenseTransformer.__init__) == _params(Transformer.__init__)
    assert issubclass(DenseModelArgs, TransformerModelArgs)
    trainer = inspect.getsource(sys.modules["torchtitan.train"])
    assert "init_weights(buffer_device=buffer_device)" in trainer and "to_empty(device=init_device)" in trainer


def test_dense_state_dict_adapter_relies_on_llama3s_helpers():
    """DenseStateDictAdapter extends Llama3StateDictAdapter's from_hf_map and calls its private q/k permutations."""
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

    from primus.torchtitan.state_dict import DenseStateDictAdapter

    for name in ("__init__", "to_hf", "from_hf"):
        assert _params(getattr(DenseStateDictAdapter, name)) == _params(getattr(Llama3StateDictAdapter, name)), name
    for name in ("_permute", "_reverse_permute"):
        assert list(inspect.signature(getattr(Llama3StateDictAdapter, name)).parameters) == [
            "self",
            "w",
            "n_heads_arg",
            "dim1",
            "dim2",
        ], name
    assert "self.from_hf_map = {" in inspect.getsource(Llama3StateDictAdapter.__init__)
    for name in ("to_hf", "from_hf"):
        assert "self.from_hf_map" in inspect.getsource(getattr(Llama3StateDictAdapter, name)), name


def test_qwen3_still_has_no_pipelining_fn():
    """models.train_spec gives qwen3 llama3's pipeline split, which needs llama3's module names."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.qwen3.model import model as qwen3
    from torchtitan.protocols.train_spec import get_train_spec

    assert get_train_spec("qwen3").pipelining_fn is None
    assert get_train_spec("llama3").pipelining_fn is pipeline_llm
    init = inspect.getsource(qwen3.Qwen3Model.__init__)
    for name in ("self.tok_embeddings", "self.layers", "self.norm", "self.output"):
        assert name in init, name


def test_router_gate_style_still_marks_its_output_gradient_replicated():
    """compat.router_gate_partial_grad: torchtitan 0.2.2's MoE TP plan parallelizes the router gate with NoParallel,
    whose local output keeps a replicated gradient placement (torchtitan#2416 adds ``local_output_grad_placements``;
    once it is there the patch goes). The swap is scoped to the parallelize call."""
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize
    from torchtitan.distributed import NoParallel

    from primus.torchtitan.compat import router_gate_partial_grad

    assert "local_output_grad_placements" not in inspect.signature(NoParallel.__init__).parameters
    assert "grad_placements" not in inspect.getsource(NoParallel._prepare_output_fn)
    assert '"moe.router.gate": NoParallel()' in inspect.getsource(llama4_parallelize.apply_moe_ep_tp)
    assert "score_before_experts=False" in inspect.getsource(importlib.import_module("torchtitan.models.qwen3"))
    with router_gate_partial_grad():
        style = llama4_parallelize.NoParallel
        assert issubclass(style, NoParallel) and style is not NoParallel
        assert "Partial()" in inspect.getsource(style._prepare_output_fn)
    assert llama4_parallelize.NoParallel is NoParallel


def test_moe_forward_still_gathers_and_combines_inline():
    """kernels.ProviderMoE re-states MoE.forward with the provider's gather and combine: the calls it keeps and the
    two steps it replaces must still be torchtitan's."""
    from torchtitan.models.moe.moe import MoE

    src = inspect.getsource(MoE.forward)
    for line in (
        "self.router(x, self.expert_bias)",
        "self.tokens_per_expert.add_(num_tokens_per_expert)",
        "self.reorderer(top_scores, selected_experts_indices)",
        "routed_input = x[token_indices_experts_sorted // self.router.top_k]",
        "routed_output = self.experts(routed_input, num_tokens_per_expert)",
        "self.shared_experts(x) if self.shared_experts is not None else None",
        "routed_output_unsorted[token_indices_experts_sorted] = routed_output",
        "top_scores.reshape(-1, 1, self.router.top_k)",
    ):
        assert line in src, line
    assert list(inspect.signature(MoE.forward).parameters) == ["self", "x"]


def test_router_forward_still_scores_chooses_and_weighs_as_the_provider_contract():
    """kernels.ProviderRouter replaces what follows the gate in TokenChoiceTopKRouter.forward with the moe_router
    provider (core's contract is this math): fp32 softmax / sigmoid, top-k of scores + bias, gather, +1e-20
    normalisation, route_scale, histc counts."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    src = inspect.getsource(TokenChoiceTopKRouter.forward)
    for line in (
        "scores = self.gate(x)",
        "torch.sigmoid(scores.to(torch.float32))",
        "F.softmax(scores.to(torch.float32), dim=1)",
        "scores_for_choice = scores if expert_bias is None else scores + expert_bias",
        "top_scores = scores.gather(dim=1, index=selected_experts_indices)",
        "denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20",
        "top_scores = top_scores * self.route_scale",
        "return top_scores, selected_experts_indices, num_tokens_per_expert",
    ):
        assert line in src, line
    assert list(inspect.signature(TokenChoiceTopKRouter.forward).parameters) == ["self", "x", "expert_bias"]


def test_router_scores_what_its_gate_returns():
    """balancing.Balancing hooks each router's gate: torchtitan's router (and ProviderRouter, which calls the same
    gate) must route by the hooked gate's output, and the gradient of what the hook returns must reach the gate."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(16, 8, None, None, 2, "softmax", route_norm=False, route_scale=1.0, gate_bias=False)
    x = torch.randn(32, 16)
    _, before, _ = router(x)
    assert not bool((before == 3).any(dim=-1).all())
    seen = []

    def hook(module, args, logits):
        seen.append(logits)
        return logits + 100.0 * torch.nn.functional.one_hot(torch.tensor(3), 8)  # expert 3 for every token

    handle = router.gate.register_forward_hook(hook)
    top_scores, chosen, counts = router(x)
    handle.remove()
    assert len(seen) == 1 and bool((chosen == 3).any(dim=-1).all()) and int(counts[3]) == 32
    top_scores.sum().backward()
    assert router.gate.weight.grad is not None and float(router.gate.weight.grad.abs().sum()) > 0


def test_qwen3_adapter_maps_layer_keys_through_from_hf_map():
    """hf.Qwen3SharedExpertsStateDictAdapter adds shared-expert entries to from_hf_map: both directions of torchtitan's
    qwen3 adapter must still read a layer's non-expert keys from it (and the experts' keys by their own path)."""
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    assert "new_key = self.from_hf_map[abstract_key]" in inspect.getsource(Qwen3StateDictAdapter.from_hf)
    assert "to_hf_map = {v: k for k, v in self.from_hf_map.items()}" in inspect.getsource(Qwen3StateDictAdapter.to_hf)
    assert 'if "mlp.experts" in key' in inspect.getsource(Qwen3StateDictAdapter.from_hf)
