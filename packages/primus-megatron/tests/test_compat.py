"""megatron-core specifics (primus.megatron.compat, layer_spec) on the installed release, 0.16.1 or 0.19.2: the
version check, the API shapes the backend relies on, and the kernel modules' numerics against megatron's own local
modules. Each patch and private override in compat.PATCHES names its test here (or in test_cpu_redirect.py); where
the two releases differ, a test asserts what the installed one does (``mc.MCORE_0_19``)."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from megatron_helpers import ONE_RANK_SCRIPT

from primus.megatron import compat as mc


def test_patch_table_names_a_test_for_every_patch():
    from primus.core.contracts.patches import table_problems

    assert table_problems(mc, Path(__file__).parent, exempt=("check_version",)) == []


def test_supported_version_installed_and_others_refused():
    """0.16.1 on Python < 3.12, 0.19.2 from 3.12 (the pyproject's markers); the one-line refusal of any other."""
    import tomllib

    import pytest

    assert mc.INSTALLED in ("0.16.1", "0.19.2") and mc.MCORE_0_19 == (mc.INSTALLED == "0.19.2")
    if sys.version_info >= (3, 12):  # (on 3.11 the compatibility session installs 0.19.2 past its Requires-Python)
        assert mc.INSTALLED == "0.19.2"
    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {r.replace(" ", "").replace('"', "'") for r in deps if r.startswith("megatron-core")}
    assert pins == {"megatron-core==0.16.1;python_version<'3.12'", "megatron-core==0.19.2;python_version>='3.12'"}
    for found in ("0.16.1", "0.19.2"):
        assert mc.check_version(found) == found
    for found in ("0.15.0", "0.17.0", "0.19.3", "0.20.0"):
        with pytest.raises(RuntimeError) as err:
            mc.check_version(found)
        assert str(err.value).startswith("primus-megatron supports megatron-core 0.16.1 (Python < 3.12) and 0.19.2 ")
        assert f"found {found}: pip install 'megatron-core==" in str(err.value) and "\n" not in str(err.value)


def test_gpt_model_rope_arguments():
    from megatron.core.models.gpt import GPTModel

    params = inspect.signature(GPTModel.__init__).parameters
    for name in (
        "rope_scaling",
        "rope_scaling_factor",
        "seq_len_interpolation_factor",
        "vp_stage",
        "share_embeddings_and_output_weights",
        "rotary_base",
    ):
        assert name in params, name
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    scaling = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    assert list(scaling)[1:] == [
        "freqs",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ]


def test_spec_slots_the_backend_fills():
    from megatron.core.transformer import attention, mlp, transformer_block

    # the MLP builds and calls the activation module only under this flag
    assert f"self.config.{mc.PLUGGABLE_ACTIVATION_FLAG}" in inspect.getsource(mlp.MLP.forward)
    # 0.16 builds the slot with build_module, 0.19 calls it (a ModuleSpec's __call__ is build_module)
    build = (
        "submodules.activation_func(config=self.config)"
        if mc.MCORE_0_19
        else "build_module(submodules.activation_func, config=self.config)"
    )
    assert build in inspect.getsource(mlp.MLP.__init__)
    # core attention is called as a class (not build_module) with these keywords
    src = inspect.getsource(attention.Attention.__init__)
    assert "submodules.core_attention(" in src
    from primus.megatron.layer_spec import KernelCoreAttention

    ours = inspect.signature(KernelCoreAttention.__init__).parameters
    for kw in (
        "config",
        "layer_number",
        "attn_mask_type",
        "attention_type",
        "cp_comm_type",
        "softmax_scale",
        "pg_collection",
    ):
        assert f"{kw}=" in src and kw in ours, kw
    # a layer spec alone gets megatron's default final norm: the backend passes block submodules
    assert "layer_norm=LayerNormImpl" in inspect.getsource(transformer_block._get_block_submodules)


def test_distributed_optimizer_step_workarounds_still_needed():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert "assert len(steps) == 1" in inspect.getsource(DistributedOptimizer.state_dict)
    assert hasattr(DistributedOptimizer, "_init_optimizer_states_with_dummy_values")
    # the per-parameter step is not saved (the request's dummy one comes back) ...
    dp_reshardable = inspect.getsource(DistributedOptimizer.sharded_param_state_dp_reshardable)
    assert (
        "if key == 'step':" in dp_reshardable
        and "tensors[key] = LocalNonpersistentObject(tensors[key])" in dp_reshardable
    )
    # ... and is copied over the restored one with the other optimizer states
    setter = inspect.getsource(DistributedOptimizer._set_main_param_and_optimizer_states)
    if mc.MCORE_0_19:  # every tensor of the state, step included
        assert 'dst_tensors = {"param": main_param}\n            for k, v in optim_state.items():' in setter
        assert "dst_tensors[k] = v" in setter and "dst_tensors[key].copy_(tensors[key])" in setter
    else:
        assert 'dst_tensors = {"param": main_param, **optim_state}' in setter


def test_optimizer_step_runs_norm_then_update():
    """compat.optimizer_step gates the update between the grad norm and the step (the health check)."""
    from megatron.core import optimizer

    assert "return ChainedOptimizer(optimizers)" in inspect.getsource(optimizer.get_megatron_optimizer)
    step = inspect.getsource(optimizer.ChainedOptimizer.step)
    assert step.index("self.prepare_grads()") < step.index("grad_norm = self.get_grad_norm()")
    assert step.index("grad_norm = self.get_grad_norm()") < step.index("self.step_with_ready_grads()")
    assert "return update_successful, grad_norm, num_zeros_in_grad" in step


def test_fused_adam_switch_reaches_megatrons_torch_adam():
    """compat.fuse_torch_adam relies on megatron-core building torch's Adam(W) itself when neither Transformer
    Engine nor apex is installed, and on the wrappers' ``chained_optimizers`` / ``.optimizer``; the fused update
    must equal the default (foreach) one."""
    from types import SimpleNamespace

    import torch
    from megatron.core import optimizer

    from primus.megatron import compat

    src = inspect.getsource(optimizer._get_megatron_optimizer_based_on_param_groups)
    assert "adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam" in src
    assert optimizer.USING_PYTORCH_OPTIMIZER  # this environment has neither TE nor apex
    assert "self.chained_optimizers = chained_optimizers" in inspect.getsource(optimizer.ChainedOptimizer.__init__)

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(2)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, foreach=True)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fused), SimpleNamespace(optimizer=None)])
    assert compat.fuse_torch_adam(chained) == 1 and fused.param_groups[0]["fused"]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, c, g in zip(params, copies, grads, strict=True):
            p.grad, c.grad = g.clone(), g.clone()
        fused.step()
        plain.step()
    for p, c in zip(params, copies, strict=True):
        torch.testing.assert_close(p, c, rtol=1e-5, atol=1e-6)


def test_foreach_multi_tensor_replaces_megatrons_local_fallbacks(monkeypatch):
    """compat.foreach_multi_tensor takes the slots megatron-core fills with its local helpers when neither TE nor
    apex is installed (the local l2 norm syncs the host once per tensor), and megatron's grad norm and clipping
    give the same numbers through it."""
    import torch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mp_optimizer

    from primus.megatron import compat
    from primus.megatron.cpu import _CudaToCpu

    # what the slots hold here, how megatron calls them, and the sync the replacement removes
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is mp_optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale
    assert clip_grads.multi_tensor_applier is utils.local_multi_tensor_applier
    assert "torch.tensor(l2)" in inspect.getsource(utils.local_multi_tensor_l2_norm)
    assert "multi_tensor_applier( l2_norm_impl," in " ".join(inspect.getsource(clip_grads.get_grad_norm_fp32).split())
    for module, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setattr(mp_optimizer, "multi_tensor_scale_impl", mp_optimizer.multi_tensor_scale_impl)
    assert compat.foreach_multi_tensor() == [
        "megatron.core.optimizer.clip_grads.l2_norm_impl",
        "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
        "megatron.core.optimizer.optimizer.multi_tensor_scale_impl",
    ]
    assert compat.foreach_multi_tensor() == []  # already in place

    torch.manual_seed(0)
    grads = [torch.randn(n, 8) * s for n, s in ((64, 3.0), (7, 0.1), (300, 1.0))]
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    norm, per = compat.foreach_l2_norm(0, None, [grads[:2], grads[2:]], True)
    assert norm.shape == (1,) and per.shape == (3,)
    torch.testing.assert_close(norm[0], want)
    torch.testing.assert_close(per, torch.stack([g.norm() for g in grads]))
    # megatron's clipping through the new slot: scaled in place to max_norm
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    with _CudaToCpu():  # megatron's device="cuda" literals and CUDA type check, on this CPU machine
        clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, float(want))
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * (1.0 / (float(want) + 1e-6)))
    # a copy into another list (megatron's main -> model params, fp16), with a dtype change
    dst = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    compat.foreach_scale(0, None, [grads, dst], 1.0)
    compat.foreach_scale(0, None, [grads, dst[:0] + dst], 0.5)
    for d, g in zip(dst, grads, strict=True):
        torch.testing.assert_close(d, (g * 0.5).bfloat16())


def test_checkpoint_writer_results_queue_is_a_module_global():
    """compat.checkpoint_writer_dies_with_rank pre-fills the global megatron's save reuses."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    name = "get_write_results_queue" if mc.MCORE_0_19 else "_get_write_results_queue"  # made public in 0.19
    src = inspect.getsource(getattr(filesystem_async, name))
    assert "global _results_queue" in src and "if _results_queue is None" in src and ".Manager()" in src
    assert f" = {name}()" in inspect.getsource(filesystem_async.FileSystemWriterAsync)


NUMERICS = textwrap.dedent("""
    import math, os, torch, torch.distributed as dist
    import torch.nn.functional as F
    from primus.megatron.cpu import redirect_to_cpu
    redirect_to_cpu()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
    from primus.megatron.dist import init_parallel, seed
    from primus.megatron.layer_spec import KernelCoreAttention, KernelRMSNorm, KernelSwiGLU
    from primus.megatron.model import UNFUSED, gpt_model
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    init_parallel(1, 1, 1, 1); seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                            kv_channels=64, ffn_hidden_size=96, hidden_dropout=0.0, attention_dropout=0.0,
                            normalization="RMSNorm", **UNFUSED)
    ref_attn = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    ours = KernelCoreAttention(cfg, 1, AttnMaskType.causal, "self", kernel="primus.core.kernels.reference:attention")
    s, b = 16, 2
    q = torch.randn(s, b, 4, 64, dtype=torch.float64).float()
    k, v = torch.randn(s, b, 2, 64), torch.randn(s, b, 2, 64)
    torch.testing.assert_close(ours(q, k, v, None), ref_attn(q, k, v, None), atol=2e-5, rtol=1e-4)

    x = torch.randn(s, b, 128)
    norm = KernelRMSNorm(cfg, 128, eps=1e-6, kernel="primus.core.kernels.reference:rms_norm")
    torch.nn.init.normal_(norm.weight)
    ref = torch.nn.RMSNorm(128, eps=1e-6); ref.weight.data.copy_(norm.weight.data)
    torch.testing.assert_close(norm(x), ref(x))

    h = torch.randn(s, b, 2 * 96)
    gate, up = h.chunk(2, -1)
    torch.testing.assert_close(KernelSwiGLU(cfg, kernel="primus.core.kernels.reference:swiglu")(h), F.silu(gate) * up)
    # a provider's packed form, where it offers one, gets fc1's output whole (primus-turbo's: no cat in the backward)
    calls = []
    def chunked(g, u):
        calls.append("chunked"); return F.silu(g) * u
    def packed(x):
        calls.append("packed"); return chunked(*x.chunk(2, -1))
    chunked.packed = packed
    torch.testing.assert_close(KernelSwiGLU(cfg, kernel=chunked)(h), F.silu(gate) * up)
    assert calls == ["packed", "chunked"], calls

    # Llama-3 RoPE scaling with non-default constants is re-applied (megatron passes only the factor)
    from primus.core.config.schema import RopeScaling
    from primus.megatron.layer_spec import block_spec
    from primus.core.contracts.plugins import get_registry
    reg = get_registry()
    kernels = {op: reg.providers(op)[0] for op in ("attention", "rms_norm", "swiglu")}
    sc = RopeScaling(type="llama3", factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
                     original_max_position_embeddings=4096)
    model = gpt_model(cfg, block_spec(cfg, kernels, qk_norm=False, vp_stage=None), vocab_size=64, max_seq=32,
                      tied=False, rope_theta=500000.0, rope_scaling=sc, vp_stage=None)
    d = 64
    freqs = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    wavelen = 2 * math.pi / freqs
    lo, hi = 4096 / 2.0, 4096 / 8.0
    smooth = (4096 / wavelen - 2.0) / (8.0 - 2.0)
    expect = torch.where(wavelen > lo, freqs / 32.0, freqs)
    mid = (wavelen >= hi) & (wavelen <= lo)
    expect = torch.where(mid, (1 - smooth) * freqs / 32.0 + smooth * freqs, expect)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.float(), expect)

    # gpt.FusedLossGPTModel (the instance retyped by fuse_loss): per-token [b, s] losses with megatron's mean
    from primus.megatron.gpt import FusedLossGPTModel, fuse_loss
    def linear_ce(h, w, target):
        return F.cross_entropy((h.float() @ w.float().t()).flatten(0, -2), target.flatten())
    plain_kernels = {op: next(p for p in reg.providers(op) if p.name == name)
                     for op, name in (("attention", "sdpa"), ("rms_norm", "torch"), ("swiglu", "torch"))}
    model = gpt_model(cfg, block_spec(cfg, plain_kernels, qk_norm=False, vp_stage=None), vocab_size=64,
                      max_seq=32, tied=False, rope_theta=10000.0, rope_scaling=None, vp_stage=None)
    ids, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    plain = model(ids, pos, None, labels=labels)
    logits = model(ids, pos, None)
    fuse_loss(model, linear_ce)
    assert type(model) is FusedLossGPTModel
    fused = model(ids, pos, None, labels=labels)
    assert fused.shape == plain.shape == labels.shape, (fused.shape, plain.shape)
    torch.testing.assert_close(fused.mean(), plain.mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(ids, pos, None), logits)  # without labels: megatron's logits
    print("ok")
""")


def test_kernel_modules_match_megatron_local_modules():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", NUMERICS % port], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_interleaved_pipeline_uses_unbatched_p2p():
    """megatron-core's batched p2p posts send_prev before send_next (and recv_prev before recv_next); with pp = 2
    one peer is both neighbours and receives them in the wrong buffers, so model.pipeline_p2p turns it off for
    the interleaved schedule, the one that sends both ways in one call (as Megatron-LM's defaults do)."""
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.transformer import TransformerConfig
    from megatron_helpers import TINY

    from primus.core.launch.resolve import resolve
    from primus.megatron.model import transformer_config

    src = inspect.getsource(p2p_communication._batched_p2p_ops)
    assert src.index("send_prev_op") < src.index("recv_prev_op") < src.index("send_next_op")
    assert src.index("send_next_op") < src.index("recv_next_op") and "batch_isend_irecv" in src
    assert TransformerConfig.__dataclass_fields__["batch_p2p_comm"].default is True

    vpp = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved_1f1b", "model.num_layers=4"]
    config = transformer_config(resolve(TINY, vpp, world_size=2).config)
    assert (config.batch_p2p_comm, config.overlap_p2p_comm) == (False, True)
    config = transformer_config(resolve(TINY, ["parallel.pp=2"], world_size=2).config)
    assert (config.batch_p2p_comm, config.overlap_p2p_comm) == (True, False)


def test_fused_loss_postprocess_matches_gptmodel():
    """gpt.FusedLossGPTModel overrides the private GPTModel._postprocess: megatron's forward must still return what
    _postprocess returns, hand it the arguments the override reads by keyword, and return per-token losses [b, s]
    of labels [b, s] from sequence-first hidden states; the attributes the override reads must still be there.
    (Its numbers against megatron's own loss: test_kernel_modules_match_megatron_local_modules.)"""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from primus.megatron.gpt import FusedLossGPTModel

    theirs = inspect.signature(GPTModel._postprocess).parameters
    assert list(theirs)[:5] == ["self", "hidden_states", "input_ids", "position_ids", "labels"]
    assert "inference_context" in theirs
    ours = list(inspect.signature(FusedLossGPTModel._postprocess).parameters.values())
    assert [p.name for p in ours[:5]] == list(theirs)[:5] and ours[-1].kind is inspect.Parameter.VAR_KEYWORD
    forward = inspect.getsource(GPTModel.forward)
    call = forward[forward.index("return self._postprocess(") :]
    call = call[: call.index("\n        )")]
    for kw in ("hidden_states", "input_ids", "position_ids", "labels", "inference_context"):
        assert f"{kw}={kw}," in call, kw
    post = inspect.getsource(GPTModel._postprocess)
    assert "if not self.post_process:\n            return hidden_states" in post
    if mc.MCORE_0_19:  # MTP runs inside _postprocess (the fused path is never taken with MTP: core's rule), MuP off
        assert post.index("hidden_states = self.mtp(") < post.index("if not self.post_process:")
        assert "if self.config.mtp_num_layers:" in post and "if output_processor is not None:" in post
        assert "logits = self._scale_logits(logits)" in post
        assert TransformerConfig.__dataclass_fields__["use_mup"].default is False
        assert "output_processor=output_processor," in call
    else:
        assert "if self.config.mtp_num_layers is not None:" in post
    assert "output_weight = self.shared_embedding_or_output_weight()" in post
    assert "self.output_layer(\n            hidden_states, weight=output_weight" in post
    assert "loss = self.compute_language_model_loss(labels, logits)" in post and "[s b h] => [b s h]" in post
    loss = inspect.getsource(LanguageModule.compute_language_model_loss)
    assert "labels = labels.transpose(0, 1).contiguous()" in loss and "loss = loss.transpose(0, 1).contiguous()" in loss
    init = inspect.getsource(GPTModel.__init__)
    for attr in ("self.post_process =", "self.share_embeddings_and_output_weights =", "self.output_layer ="):
        assert attr in init, attr
    assert "mtp_num_layers" in TransformerConfig.__dataclass_fields__


def test_rope_override_points_are_megatrons():
    """rope.KernelRoPESelfAttention runs megatron's SelfAttention.forward with rotary_pos_emb=None and rotates q/k at
    the end of get_query_key_value_tensors: megatron must still make q/k there, before its own RoPE (applied only
    when rotary_pos_emb is given), and TransformerLayer must pass the arguments the override reads by keyword."""
    from megatron.core.transformer import TransformerConfig, attention, transformer_layer

    params = list(inspect.signature(attention.Attention.forward).parameters)
    assert params[:3] == ["self", "hidden_states", "attention_mask"]
    for kw in ("rotary_pos_emb", "packed_seq_params", "inference_context", "inference_params"):
        assert kw in params, kw
    src = inspect.getsource(attention.Attention.forward)
    qkv, rope = src.index("self.get_query_key_value_tensors("), src.index("if rotary_pos_emb is not None and (")
    assert qkv < rope < src.index("apply_rotary_pos_emb(")
    assert "query, key, value = qkv_output" in src  # the split q, k, v come first
    assert list(inspect.signature(attention.SelfAttention.get_query_key_value_tensors).parameters) == [
        "self",
        "hidden_states",
        "key_value_states",
        "output_gate",
        "split_qkv",
    ]
    layer = inspect.getsource(transformer_layer)
    call = layer[layer.index("self.self_attention(") :]
    call = call[: call.index("\n        )")]
    for kw in ("attention_mask", "rotary_pos_emb", "packed_seq_params", "inference_context"):
        assert f"{kw}={kw}," in call, kw
    fields = TransformerConfig.__dataclass_fields__
    for name in ("rotary_interleaved", "multi_latent_attention", "apply_rope_fusion", "fused_single_qkv_rope"):
        assert name in fields, name
    assert "no_rope_freq" in fields
    assert "self.hidden_size_per_attention_head = " in inspect.getsource(attention.Attention.__init__)


def test_fp8_linears_override_megatrons_forward_impl():
    """fp8's tensor-parallel linears replace the private _forward_impl that Column/RowParallelLinear.forward call
    with keyword arguments only; the FP8 forward names each of them (a renamed one would fall into its ``**_``), and
    ColumnParallelLinear.forward reads allreduce_dgrad from the instance attribute the FP8 column linear clears."""
    from megatron.core.tensor_parallel import layers

    from primus.megatron.fp8 import linear_classes

    impl = SimpleNamespace(Fp8State=lambda history: None, fp8_linear=lambda *a, **k: None)
    column, row = linear_classes(SimpleNamespace(name="test-compat-fp8", load=lambda: impl))
    ours = {name for name in inspect.signature(column._forward_impl).parameters if name not in ("self", "_")}
    assert column._forward_impl is row._forward_impl and issubclass(column, layers.ColumnParallelLinear)
    passed = set()
    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        assert list(inspect.signature(cls._forward_impl).parameters) == ["self", "input", "weight", "args", "kwargs"]
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "_forward_impl"
        ]
        assert len(calls) == 1 and not calls[0].args, cls
        keywords = {k.arg for k in calls[0].keywords}
        assert keywords <= ours, (cls, keywords - ours)
        passed |= keywords
    assert ours - passed == (set() if mc.MCORE_0_19 else {"gtp_remat_size"}), ours - passed  # new in 0.19
    assert "allreduce_dgrad = False if self.explicit_expert_comm else self.allreduce_dgrad" in inspect.getsource(
        layers.ColumnParallelLinear.forward
    )
    assert "self.allreduce_dgrad = (" in inspect.getsource(layers.ColumnParallelLinear.__init__)


def test_fsdp2_wrapper_gaps_still_there():
    """fsdp.FSDP2's two methods: 0.16's finalize_model_grads passes force_all_reduce to finish_grad_sync, which the
    FSDP2 wrapper's base class does not take, and its scale_gradients does nothing."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    assert "finish_grad_sync(force_all_reduce=force_all_reduce)" in inspect.getsource(finalize_model_grads)
    assert "force_all_reduce" not in inspect.signature(_BaseDataParallel.finish_grad_sync).parameters
    body = ast.parse(textwrap.dedent(inspect.getsource(_BaseDataParallel.scale_gradients))).body[0].body
    assert [type(node) for node in body] == [ast.Expr, ast.Pass]  # docstring, pass


def test_fsdp2_optimizer_ids_still_by_to_local():
    """fsdp.optimizer_param_ids: megatron keys optimizer parameters by id(to_local_if_dtensor(param)), and torch's
    DTensor.to_local() of a parameter returns a fresh view (not the _local_tensor the sharded tensors hold)."""
    from megatron.core.dist_checkpointing import optimizer as optim_ckpt
    from torch.distributed.tensor import DTensor

    assert "id(param)" in inspect.getsource(optim_ckpt.get_optim_param_to_id_map)
    assert "to_local_if_dtensor(param)" in inspect.getsource(optim_ckpt.get_optim_param_to_id_map)
    assert "result.view_as(result)" in inspect.getsource(DTensor.to_local)


def test_moe_utils_misses_te_general_gemm_without_te():
    """compat.moe_without_te: megatron's router gating linear reads te_general_gemm, which moe_utils defines only
    when Transformer Engine imports (it is not installed here)."""
    from megatron.core.transformer.moe import moe_utils

    assert not moe_utils.HAVE_TE
    assert "te_general_gemm is not None" in inspect.getsource(moe_utils.RouterGatingLinearFunction.forward)
    had = hasattr(moe_utils, "te_general_gemm")
    assert mc.moe_without_te() is not had and moe_utils.te_general_gemm is None


def test_megatrons_optimizer_takes_cores_weight_decay_rule():
    """The config_overrides handed to get_megatron_optimizer match exactly the parameters core exempts (1-D: norms,
    biases), through megatron's own ParamKey.matches, with wd_mult 0."""
    import torch

    from primus.megatron.engine import _weight_decay_overrides

    ((key, override),) = _weight_decay_overrides().items()
    params = {
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.nn.Parameter(torch.zeros(6, 4)),
        "decoder.layers.0.mlp.experts.weight1": torch.nn.Parameter(torch.zeros(2, 4, 8)),
        "decoder.layers.0.input_layernorm.weight": torch.nn.Parameter(torch.ones(4)),
        "decoder.layers.0.self_attention.linear_qkv.bias": torch.nn.Parameter(torch.zeros(6)),
    }
    assert {name: key.matches(p, name) for name, p in params.items()} == {
        "decoder.layers.0.self_attention.linear_qkv.weight": False,
        "decoder.layers.0.mlp.experts.weight1": False,
        "decoder.layers.0.input_layernorm.weight": True,
        "decoder.layers.0.self_attention.linear_qkv.bias": True,
    }
    assert override == {"wd_mult": 0.0}


def test_stacked_experts_are_built_and_called_as_megatrons_experts():
    """experts.StackedExperts in the MoE layer's experts slot: megatron builds it with the arguments it builds
    SequentialMLP with (0.16 through build_module, 0.19 by calling the spec and adding ``name=``) and calls it with
    SequentialMLP's three tensors."""
    from megatron.core.transformer.moe import moe_layer
    from megatron.core.transformer.moe.experts import SequentialMLP

    from primus.megatron.experts import StackedExperts

    tree = ast.parse(textwrap.dedent(inspect.getsource(moe_layer.MoELayer.__init__)))
    (call,) = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self.experts" and isinstance(n.value, ast.Call)
    ]
    args = [ast.unparse(a) for a in call.args]
    if mc.MCORE_0_19:
        assert ast.unparse(call.func) == "self.submodules.experts"
    else:
        assert ast.unparse(call.func) == "build_module" and args.pop(0) == "self.submodules.experts"
    assert args == ["self.num_local_experts", "self.config"]
    keywords = {k.arg for k in call.keywords}
    assert keywords == ({"pg_collection", "name"} if mc.MCORE_0_19 else {"pg_collection"})
    ours = inspect.signature(StackedExperts.__init__).parameters
    assert list(ours)[1:3] == ["num_local_experts", "config"] and keywords | {"submodules"} <= set(ours)
    theirs = inspect.signature(SequentialMLP.forward).parameters
    assert list(inspect.signature(StackedExperts.forward).parameters) == list(theirs)
    forward = " ".join(inspect.getsource(moe_layer.MoELayer).split())
    if mc.MCORE_0_19:  # its extra keywords only for NCCL-EP's zero-copy buffers (not the all-to-all dispatcher)
        assert "apply_module(self.experts)( dispatched_input, tokens_per_expert, permuted_probs, **expert_kwargs )" in (
            forward
        )
        assert "if output_buffer is not None:" in forward
    else:
        assert "self.experts(dispatched_input, tokens_per_expert, permuted_probs)" in forward


def test_cp_batch_arguments():
    """compat.batch_on_this_cp_rank passes get_batch_on_this_cp_rank the context-parallel group (and 0.19's required
    is_hybrid_cp): 0.16 looks the group up for None, 0.19 takes the size of None's group, the whole world. (Its
    numbers: the cp2 layouts of test_train_layouts.py::test_layout_matches_world_size_1.)"""
    from megatron.core import utils

    params = list(inspect.signature(utils.get_batch_on_this_cp_rank).parameters)
    if mc.MCORE_0_19:
        assert params[:3] == ["batch", "is_hybrid_cp", "cp_group"]
        assert inspect.signature(utils.get_batch_on_this_cp_rank).parameters["is_hybrid_cp"].default is (
            inspect.Parameter.empty
        )
        split = inspect.getsource(utils._get_batch_on_this_cp_rank_per_sequence_balancing)
        assert "cp_size = torch.distributed.get_world_size(cp_group)" in split and "parallel_state" not in split
        assert 'batch.get("cu_seqlens") is None' in inspect.getsource(utils.get_batch_on_this_cp_rank)
    else:
        assert params == ["batch", "cp_group"]
        assert "cp_size = parallel_state.get_context_parallel_world_size()" in inspect.getsource(
            utils.get_batch_on_this_cp_rank
        )


def test_mla_reads_its_linear_types_from_module_globals():
    """compat.mla_without_te: MLASelfAttention type-checks its output projection against the module's TELinear (under
    HAVE_TE) and its down projections against TELinear / Linear / TEColumnParallelLinear, module globals. Without TE
    0.16 holds TE's placeholders there, 0.19 None in all of them, Linear (the replicated one deepseek.whole_linear
    takes) included; after the patch the TE names are None and Linear modelopt's class, on either release."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention as mla

    assert "HAVE_TE\n            and isinstance(self.linear_proj, TELinear)" in inspect.getsource(
        mla.MultiLatentAttention.__init__
    )
    init = " ".join(inspect.getsource(mla.MLASelfAttention.__init__).split())
    for proj in ("linear_q_down_proj", "linear_kv_down_proj"):
        assert f"if submodules.{proj} in [TELinear]:" in init
        assert f"elif submodules.{proj} in [ Linear, TEColumnParallelLinear, ColumnParallelLinear, ]:" in init
    before = (mla.HAVE_TE, mla.TELinear, mla.Linear)
    changed = mc.mla_without_te()
    if changed:  # (not where an earlier test of this process applied it)
        if mc.MCORE_0_19:
            assert changed == ["Linear"] and before == (False, None, None)
        else:
            assert changed == ["HAVE_TE", "TELinear", "TEColumnParallelLinear"] and before[0] and before[2] is Linear
    assert (mla.HAVE_TE, mla.TELinear, mla.TEColumnParallelLinear, mla.Linear) == (False, None, None, Linear)
    assert mc.mla_without_te() == []


MLA_BUILD = ONE_RANK_SCRIPT + textwrap.dedent("""
    from primus.megatron.layer_spec import KernelRMSNorm, block_spec, mtp_block_spec
    from primus.megatron.model import gpt_model, transformer_config
    from megatron.core.transformer.moe.router import TopKRouter
    from primus.megatron import compat
    names = {"attention": "sdpa", "rms_norm": "torch", "swiglu": "torch", "grouped_gemm": "torch"}  # CPU's own
    kernels = {op: next(p for p in reg.providers(op) if p.name == name) for op, name in names.items()}
    model = model_config("tiny-deepseek", reg).model_dump()
    # DeepSeek-V3's query latent with a multi-token-prediction depth; DeepSeek-V2-Lite's full q projection
    for q_lora, mtp in ((64, {"layers": 1}), (None, None)):
        model["mla"]["q_lora_rank"], model["mtp"] = q_lora, mtp
        cfg = PrimusConfig.model_validate({"model": model, "train": {"seq_len": 32}})
        m, config = cfg.model, transformer_config(cfg)
        spec = block_spec(config, kernels, qk_norm=m.qk_norm, vp_stage=None, mla=True)
        gpt = gpt_model(config, spec, vocab_size=m.vocab_size, max_seq=32, tied=False, rope_theta=m.rope_theta,
                        rope_scaling=None, vp_stage=None, mtp=mtp_block_spec(config, spec, kernels, None))
        attn = gpt.decoder.layers[0].self_attention
        assert isinstance(attn.kv_layernorm, KernelRMSNorm), attn
        assert isinstance(getattr(attn, "q_layernorm", None), KernelRMSNorm) == (q_lora is not None), attn
        assert hasattr(attn, "linear_q_up_proj" if q_lora else "linear_q_proj"), attn
        ids = torch.randint(0, m.vocab_size, (2, 32))
        loss = gpt(ids, torch.arange(32).expand(2, 32), None, labels=ids, **({"loss_mask": None} if mtp else {}))
        loss.float().mean().backward()
        assert loss.shape == (2, 32) and attn.kv_layernorm.weight.grad is not None
        if mtp:  # the depth trained beside the main loss, and megatron recorded its loss
            assert gpt.mtp.layers[0].eh_proj.weight.grad is not None
            recorded = compat.take_mtp_losses()
            assert recorded.shape == (1,) and float(recorded[0]) > 0 and compat.take_mtp_losses().sum() == 0
            # the routers' rows: the decoder's MoE layers 1 and 2 (layer 0 dense), then the depth's, 3
            routers = [r for r in gpt.modules() if isinstance(r, TopKRouter)]
            assert [compat.router_layer(r) for r in routers] == [1, 2, 3], [r.layer_number for r in routers]
    print("ok")
""")


def test_mla_latent_norms_come_from_the_spec():
    """compat.mla_self_attention: 0.16's MLASelfAttention builds its latent norms and up projections from the spec;
    0.19's asks _resolve_qk_norm_config (megatron's QKNormConfigResolver, by config.qk_layernorm), which refuses the
    spec's norms with it off and, with it on and no q_lora_rank, wants TE's fused norm + linear. The class compat
    returns on 0.19 gives the spec's modules back; a tiny DeepSeek-V3 (with a multi-token-prediction depth) and a
    V2-Lite-shaped (no query latent) MLA build with both latent norms (the query's only with its latent) and train."""
    from megatron.core.transformer import multi_latent_attention as mla

    cls = mc.mla_self_attention()
    init = inspect.getsource(mla.MLASelfAttention.__init__)
    if mc.MCORE_0_19:
        from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

        assert issubclass(cls, mla.MLASelfAttention) and cls is not mla.MLASelfAttention
        assert "layer_classes = self._resolve_qk_norm_config(submodules)" in init
        for name in mc.MLA_RESOLVED:
            assert f'layer_classes["{name}"]' in init, name
        assert "qk_layernorm/qk_l2_norm are supposed to be disabled" in inspect.getsource(QKNormConfigResolver)
        submodules = SimpleNamespace(**{name: object() for name in mc.MLA_RESOLVED})
        assert cls._resolve_qk_norm_config(None, submodules) == vars(submodules)
    else:
        assert cls is mla.MLASelfAttention and not hasattr(cls, "_resolve_qk_norm_config")
        for name in mc.MLA_RESOLVED:
            assert f"submodules.{name}," in init, name
    proc = subprocess.run([sys.executable, "-c", MLA_BUILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_dense_mlp_slot():
    """compat.dense_mlp: the transformer layer builds its mlp slot from a ModuleSpec of MLP with MLP's own keywords
    (0.16); 0.19 calls the slot with (config, pg_collection, is_mtp_layer, name) and rewraps a ModuleSpec of MLP into
    MLP.as_mlp_submodule, the builder compat hands it directly."""
    import functools

    from megatron.core.transformer import transformer_layer
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    init = inspect.getsource(transformer_layer.TransformerLayer.__init__)
    submodules = MLPSubmodules(linear_fc1=None, linear_fc2=None)
    slot = mc.dense_mlp(submodules)
    if mc.MCORE_0_19:
        assert "submodules.mlp.module.as_mlp_submodule," in init and "Rewrapping ModuleSpec" in init
        call = init[init.index("self.mlp = submodules.mlp(") :]
        call = call[: call.index("\n        )")]
        for kw in ("config", "pg_collection", "is_mtp_layer", "name"):
            assert f"{kw}=" in call, kw
        params = inspect.signature(MLP.as_mlp_submodule).parameters
        assert list(params)[:4] == ["submodules", "config", "pg_collection", "is_mtp_layer"] and "name" in params
        assert isinstance(slot, functools.partial) and slot.func == MLP.as_mlp_submodule
        assert slot.keywords == {"submodules": submodules}
    else:
        assert "elif submodules.mlp.module == MLP:" in init
        assert "self.mlp = build_module(submodules.mlp, config=self.config, **additional_mlp_kwargs)" in init
        assert slot.module is MLP and slot.submodules is submodules and not hasattr(MLP, "as_mlp_submodule")


def test_mtp_depth_slot_and_router_rows():
    """compat.mtp_layer_submodules: the multi-token-prediction layer builds its transformer layer from the slot 0.16
    names transformer_layer and 0.19 mtp_model_layer (0.19 maps the checkpoint keys back to transformer_layer.).
    compat.router_layer: the row of megatron's per-layer MoE records a depth's router writes to (its numbers on a tiny
    DeepSeek-V3: test_mla_latent_norms_come_from_the_spec)."""
    from megatron.core.transformer.moe import router
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    slot = "mtp_model_layer" if mc.MCORE_0_19 else "transformer_layer"
    init = inspect.getsource(MultiTokenPredictionLayer.__init__)
    assert f"self.{slot} = build_module(\n                self.submodules.{slot}," in init or (
        f"self.{slot} = build_module(\n            self.submodules.{slot}," in init
    )
    built = mc.mtp_layer_submodules("layer", enorm="norm", hnorm="norm", eh_proj="proj", layer_norm="norm")
    assert getattr(built, slot) == "layer"
    helper = inspect.getsource(__import__("megatron.core.transformer.multi_token_prediction", fromlist=["x"]))
    if mc.MCORE_0_19:  # what compat.take_mtp_losses reads and clears
        assert 'tracker["loss_values"][layer_number] += loss.detach()' in helper
        assert "def clean_metrics_in_tracker():" in helper
    else:
        assert 'tracker["values"][layer_number] += loss.detach()' in helper and "def clean_loss_in_tracker():" in helper
    record = inspect.getsource(router.TopKRouter)
    if mc.MCORE_0_19:
        assert "prefix}mtp_model_layer.': f'{prefix}transformer_layer.'" in inspect.getsource(
            MultiTokenPredictionLayer.sharded_state_dict
        )
        assert "layer_number = self.layer_number + self.config.num_layers" in record  # where it records
        assert "is_mtp_layer or not add_layer_offset:\n            self.layer_number = layer_number" in (
            inspect.getsource(
                __import__("megatron.core.transformer.transformer_layer", fromlist=["x"]).TransformerLayer
            )
        )
    else:
        assert "self.layer_number + diff_transformer_layer_offset" in init and "is_mtp_layer" not in record
    depth = SimpleNamespace(layer_number=1, is_mtp_layer=True, config=SimpleNamespace(num_layers=3))
    assert mc.router_layer(depth) == (3 if mc.MCORE_0_19 else 0)  # (0.16 numbers it 4 itself)
