"""DeepSeek-V3-class models in core: the presets' parameter counts against the published ones (core's model math,
MLA included), the config rules of MLA and group-limited routing, and the HF contract (names, shapes, config.json)
against transformers' own DeepseekV3ForCausalLM."""

from __future__ import annotations

import json

import pytest

from primus.core.config.errors import ConfigError
from primus.core.config.presets import model_config
from primus.core.config.validate import validate_config
from primus.core.planner.modelmath import count_params, flops_per_token, matmul_params

# (published billions, what the publisher counts). DeepSeek counts the parameters of every matmul a token runs
# (the output head in, the embedding lookup out: modelmath.matmul_params); Moonlight's card counts both embedding
# tables out. Each quoted figure is rounded: half a unit of its last digit is allowed on top of 1%.
PUBLISHED = {
    "deepseek-v3": {"total": (671, "all"), "active": (37, "matmul")},
    "deepseek-v2-lite": {"total": (15.7, "all"), "active": (2.4, "matmul")},
    "moonlight-16b-a3b": {"total": (15.29, "non_embedding"), "active": (2.24, "non_embedding")},
}


def _count(m, which: str, convention: str) -> float:
    p = count_params(m)
    if convention == "all":
        n = p.total if which == "total" else p.active
    elif convention == "matmul":
        n = p.total - p.embedding if which == "total" else matmul_params(m)
    else:
        n = (p.total if which == "total" else p.active) - p.embedding - p.output_head
    return n / 1e9


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("which", ["total", "active"])
def test_counts_match_published(registry, name, which):
    billions, convention = PUBLISHED[name][which]
    ours = _count(model_config(name, registry), which, convention)
    digits = len(str(billions).split(".")[1]) if "." in str(billions) else 0
    tol = 0.01 * billions + 0.5 * 10**-digits
    assert abs(ours - billions) <= tol, f"{name} {which}: {ours:.3f}B vs published {billions}B ({convention})"


def test_deepseek_v3_counts_by_hand(registry):
    """DeepSeek-V3's layer by hand: MLA (q 1536 / kv 512 latents, their norms), 256 experts + 1 shared + router and
    its bias; 3 dense layers of width 18432."""
    m = model_config("deepseek-v3", registry)
    d, h = 7168, 128
    attn = d * 1536 + 1536 + 1536 * h * 192 + d * 576 + 512 + 512 * h * 256 + h * 128 * d
    expert = 3 * d * 2048
    moe_layer = attn + 2 * d + 256 * expert + expert + 256 * d + 256
    p = count_params(m)
    assert p.moe_layers == 58 and p.moe_layer == moe_layer
    assert p.moe_layer_active == moe_layer - 248 * expert
    assert p.total == 2 * 129280 * d + 3 * (attn + 2 * d + 3 * d * 18432) + 58 * moe_layer + d
    # attention FLOPs: QK^T over 192 dims, AV over 128, 61 layers, 128 heads
    assert flops_per_token(m, 4096) == pytest.approx(6 * matmul_params(m) + 6 * 61 * h * (192 + 128) * 4096)


BASE = {
    "family": "deepseek",
    "num_kv_heads": 4,
    "mla": {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
    "moe": {"num_experts": 8, "experts_per_token": 2, "expert_groups": 4, "router": "sigmoid"},
}


@pytest.mark.parametrize(
    ("change", "key", "needle"),
    [
        ({"mla": None}, "model.mla", "go together"),
        ({"family": "qwen3"}, "model.family", "go together"),
        ({"mla": {**BASE["mla"], "qk_rope_head_dim": 7}}, "model.mla.qk_rope_head_dim", "even"),
        ({"num_kv_heads": 2}, "model.num_kv_heads", "own key and value"),
        ({"qk_norm": True}, "model.qk_norm", "has none"),
        ({"moe": {**BASE["moe"], "expert_groups": 3}}, "model.moe.expert_groups", "groups of 2 or more"),
        ({"moe": {**BASE["moe"], "groups_per_token": 5}}, "model.moe.groups_per_token", "exceeds model.moe.expert_"),
        (
            {"moe": {**BASE["moe"], "experts_per_token": 5, "groups_per_token": 2}},
            "model.moe.experts_per_token",
            "hold",
        ),
        ({"mla": {**BASE["mla"], "kv_lora_rank": 0}}, "model.mla.kv_lora_rank", "greater than 0"),
        ({"moe": {**BASE["moe"], "bogus": 1}}, "model.moe.bogus", "unknown key"),
    ],
)
def test_refusals_name_the_key(change, key, needle):
    body = {k: v for k, v in (BASE | change).items() if v is not None}
    with pytest.raises(ConfigError) as info:
        validate_config({"model": body}, world_size=1)
    assert key in str(info.value) and needle in str(info.value), str(info.value)


def test_the_tiny_preset_is_valid(registry):
    from primus.core.config.schema import PrimusConfig
    from primus.core.config.validate import semantic_issues

    assert semantic_issues(PrimusConfig(model=model_config("tiny-deepseek", registry))) == []


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """transformers' DeepseekV3ForCausalLM of core's config.json for tiny-deepseek, saved."""
    import torch
    import transformers

    from primus.core.contracts.plugins import get_registry
    from primus.core.hf.config import hf_config

    m = model_config("tiny-deepseek", get_registry())
    cfg = hf_config(m)
    config = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf_deepseek")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return m, folder


def test_hf_names_and_shapes_are_transformers(hf_tiny):
    """Every tensor transformers saves is one core names (init.shapes, by HF name), with the same shape."""
    from safetensors import safe_open

    from primus.core.run import initial_weights as init

    m, folder = hf_tiny
    saved = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            saved |= {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118
    ours = {k: tuple(v[0]) for k, v in init.shapes(m).items()}
    assert ours == saved


def test_config_json_round_trips(hf_tiny):
    from primus.core.hf.config import check_matches, model_config_from_hf

    m, folder = hf_tiny
    hf = json.loads((folder / "config.json").read_text())
    back = model_config_from_hf(hf)
    assert back.model_dump() == m.model_copy(update={"name": back.name}).model_dump()
    check_matches(m, hf, "here")
    from primus.core.hf.config import HFConfigError

    # DeepSeek-V3's multi-token-prediction depth is model.mtp, and written back
    with_mtp = model_config_from_hf(hf | {"num_nextn_predict_layers": 1})
    assert with_mtp.mtp is not None and with_mtp.mtp.layers == 1 and with_mtp.mtp.loss_scale == 0.1
    from primus.core.hf.config import hf_config

    assert hf_config(with_mtp)["num_nextn_predict_layers"] == 1 and hf["num_nextn_predict_layers"] == 0
    for key, value in (("scoring_func", "softmax"), ("moe_layer_freq", 2)):
        with pytest.raises(HFConfigError, match=f"config.json {key} "):
            model_config_from_hf(hf | {key: value})
    with pytest.raises(HFConfigError, match="'expert_groups': 2"):
        other = m.model_copy(update={"moe": m.moe.model_copy(update={"expert_groups": 2})})
        check_matches(other, hf, "here")


def test_planner_counts_mla_widths_and_latents(registry):
    """The planner's attention terms under MLA: FLOPs over the mean of the q/k (192) and value (128) head widths,
    not hidden / heads (56); activations of q, k (192 per head), v, output (128 per head) and the latents; a KV cache
    of the compressed latent and the shared RoPE key (576 values per token and layer, vs 2·128·192 expanded)."""
    from primus.core.config.deepseek import attention_activation_elements, head_width, kv_cache_per_token

    m = model_config("deepseek-v3", registry)
    assert head_width(m) == 160 and m.kv_channels == 56
    assert attention_activation_elements(m) == 2 * 128 * 192 + 2 * 128 * 128 + 2 * 1536 + 2 * 512 + 64
    assert kv_cache_per_token(m) == 576
    dense = model_config("qwen3-8b", registry)
    assert head_width(dense) == dense.kv_channels


def test_one_tensor_parallel_ranks_latent_attention_linears(registry):
    """Both engines' per-rank MLA shapes under TP: the down projections whole, o split by its input, q_b and kv_b by
    their output (DeepSeek-V3: 7168 -> 1536 whole; 1536 -> 128 × 192 / 8; 128 × 128 / 8 -> 7168)."""
    from primus.core.config.deepseek import attention_linears
    from primus.core.kernels.linears import attention_linears as rank_linears

    m = model_config("deepseek-v3", registry)
    whole, rank = attention_linears(m), {role: linear.shape for role, linear in rank_linears(m, 8).items()}
    assert rank["q_a"] == whole["q_a"] == (7168, 1536) and rank["kv_a"] == whole["kv_a"] == (7168, 576)
    assert rank["q_b"] == (1536, 128 * 192 // 8) and rank["kv_b"] == (512, 128 * 256 // 8)
    assert rank["o"] == (128 * 128 // 8, 7168)
    assert {role: linear.shape for role, linear in rank_linears(m, 1).items()} == whole


def test_multi_token_prediction_names_shapes_and_counts(registry):
    """model.mtp: depth k is layer num_layers + k of a DeepSeek-V3 folder (its block's tensors, enorm, hnorm,
    eh_proj [h, 2h], shared_head.norm), drawn by the canonical init like the others; the planner counts them in the
    total and active parameters, and their head GEMM and attention in the FLOPs; another family is refused."""
    from primus.core.hf.contract import hf_names
    from primus.core.run import initial_weights as init

    m = model_config("tiny-deepseek", registry)
    d, layers = m.hidden_size, m.num_layers
    with_mtp = m.model_copy(update={"mtp": {"layers": 1}})
    with_mtp = type(m).model_validate(with_mtp.model_dump())
    extra = [n for n in hf_names(with_mtp) if n not in hf_names(m)]
    p = f"model.layers.{layers}."
    assert {p + s for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")} <= set(extra)
    assert p + "mlp.experts.0.down_proj.weight" in extra and p + "self_attn.kv_a_proj_with_mqa.weight" in extra
    shapes = init.shapes(with_mtp)
    assert set(shapes) == set(hf_names(with_mtp))
    assert shapes[p + "eh_proj.weight"] == ((d, 2 * d), "normal") and shapes[p + "enorm.weight"] == ((d,), "ones")
    base, more = count_params(m), count_params(with_mtp)
    layer = more.moe_layer  # the depth's block is an MoE one, as layer num_layers would be
    assert more.total - base.total == layer + 2 * d * d + 3 * d
    assert more.active - base.active == more.moe_layer_active + 2 * d * d + 3 * d
    assert matmul_params(with_mtp) - matmul_params(m) == more.active - base.active + m.vocab_size * d
    assert flops_per_token(with_mtp, 64) > flops_per_token(m, 64) + 6 * m.vocab_size * d
    with pytest.raises(ConfigError, match="model.mtp"):
        validate_config({"model": {"name": "x", "mtp": {"layers": 1}}}, world_size=1)


def test_multi_token_prediction_memory(registry):
    """The planner's memory with model.mtp: the depth's parameters (its experts split over EP like the others'), one
    more block's activations, and a head's logits again; an engine that keeps its own loss under MTP (profile
    ``fused_loss_refused["mtp"]``) holds every logit, which the fused loss would not."""
    from primus.core.planner import calibration as cal
    from primus.core.planner.engine_profile import EngineProfile
    from primus.core.planner.memory import KernelTerms, Layout, estimate, routed_expert_params

    m = model_config("tiny-deepseek", registry)
    with_mtp = type(m).model_validate(m.model_dump() | {"mtp": {"layers": 1}})
    keeps_own = EngineProfile(name="own-under-mtp", fused_loss_refused={"mtp": "its own loss"})
    fused = KernelTerms(fused_loss=True)
    for ep in (1, 2):
        lay = Layout("own-under-mtp", "ddp", 2, ep=ep, profile=keeps_own)
        base, more = estimate(m, lay, 256, kernels=fused).parts, estimate(with_mtp, lay, 256, kernels=fused).parts
        depth = count_params(with_mtp).mtp
        on_device = depth - routed_expert_params(m) + routed_expert_params(m) / ep
        assert more["weights"] - base["weights"] == pytest.approx(on_device * keeps_own.weight_bytes)
        assert more["activations"] > base["activations"]
        # no fused loss under MTP: both heads' logits, their fp32 loss copies kept for the backward
        logits = 256 * m.vocab_size * (2 + cal.LOGITS_EXTRA_BYTES + cal.LOSS_COPY_BYTES)
        assert more["logits"] == pytest.approx(logits) and base["logits"] < logits / 4
    assert keeps_own.fused_loss_refusal(tp=1, mtp=True) == "its own loss" and not keeps_own.fused_loss_refusal(tp=1)


def test_latent_attention_with_context_parallelism_is_refused(registry):
    """parallel.cp with MLA: the ring attention takes one head width for q, k and v (both engines reached it and
    raised at the first step)."""
    data = model_config("tiny-deepseek", registry).model_dump(mode="json")
    with pytest.raises(ConfigError, match="parallel.cp.*v_head_dim"):
        validate_config({"model": data, "parallel": {"cp": 2}}, world_size=2, registry=registry)


def test_a_folders_prediction_depths_are_read_only_by_a_model_with_them(registry):
    """The tensors of layers past the model's (DeepSeek-V3's multi-token-prediction depth, and its embedding and head
    copies) are left unread by a model without model.mtp, as transformers leaves them; a model with model.mtp whose
    folder lacks them is told to set model.mtp=null."""
    from primus.core.hf.contract import hf_names, mtp_names, tensor_problem, unmapped

    m = model_config("tiny-deepseek", registry)
    with_mtp = type(m).model_validate(m.model_dump() | {"mtp": {"layers": 1}})
    depth = list(mtp_names(with_mtp, 0).values()) + [f"model.layers.{m.num_layers}.embed_tokens.weight"]
    assert unmapped(hf_names(m) + depth, m) == []
    assert unmapped(hf_names(m) + ["model.layers.1.mlp.bogus.weight"], m) == ["model.layers.1.mlp.bogus.weight"]

    class Reader:
        weight_map = dict.fromkeys(hf_names(m))

        def __contains__(self, name):
            return name in self.weight_map

    assert "set model.mtp=null" in tensor_problem(with_mtp, Reader())
    assert tensor_problem(m, Reader()) is None


@pytest.fixture(scope="module")
def hf_as_transformers_writes(tmp_path_factory):
    """transformers' DeepseekV3ForCausalLM of tiny-deepseek's shape, its config.json as transformers writes it when
    not told otherwise: num_nextn_predict_layers 1 (its default), and no weights of that depth (its model has none).
    A second folder holds the depth's weights too."""
    import shutil

    import torch
    import transformers
    from safetensors.torch import save_file

    from primus.core.contracts.plugins import get_registry
    from primus.core.hf.config import hf_config, model_config_from_hf
    from primus.core.hf.contract import mtp_names
    from primus.core.run import initial_weights as init

    skip = ("architectures", "model_type", "num_nextn_predict_layers", "num_mtp_layers")
    cfg = hf_config(model_config("tiny-deepseek", get_registry()))
    config = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in skip})
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf_deepseek_default")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    hf = json.loads((root / "hf" / "config.json").read_text())
    assert hf["num_nextn_predict_layers"] == 1
    shutil.copytree(root / "hf", root / "hf_mtp")
    m = model_config_from_hf(hf)
    save_file({n: init.tensor(n, m, 7) for n in mtp_names(m, 0).values()}, root / "hf_mtp" / "mtp.safetensors")
    return root / "hf", root / "hf_mtp"


def _mtp(config, *overrides):
    """model.mtp as train.init_from and `primus checkpoint import --from-hf` each take it (both must agree)."""
    from primus.core.launch.resolve import config_with_hf_model, resolve

    folder = next(o.split("=", 1)[1] for o in overrides if o.startswith("train.init_from="))
    res = resolve(config, list(overrides), world_size=1, check_plugins=False)
    others = [o for o in overrides if not o.startswith("train.init_from=")]
    imported = config_with_hf_model(config, others, folder, check_plugins=False)  # core's tests: no backend here
    assert imported.model.mtp == res.config.model.mtp
    return res.config.model.mtp, res.layers.notes


def test_init_from_takes_multi_token_prediction_as_import_does(hf_as_transformers_writes, tmp_path):
    """train.init_from of a folder as transformers writes it (num_nextn_predict_layers 1, no weights): no model.mtp,
    said in a note; the user's model.mtp=null, on the command line or in their file, is taken; with the depth's
    weights in the folder model.mtp is on unless the user says null. A model.mtp the user set that the folder cannot
    supply is refused in one line naming model.mtp."""
    bare, with_weights = hf_as_transformers_writes
    start = f"train.init_from={bare}"
    mtp, notes = _mtp("tiny-deepseek", start)
    assert mtp is None
    assert notes == [
        f"train.init_from: {bare / 'config.json'} names 1 multi-token-prediction depth(s) (num_nextn_predict_layers) "
        "without their weights, as transformers writes it: no model.mtp"
    ]
    assert _mtp("tiny-deepseek", start, "model.mtp=null") == (None, [])
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"extends: [tiny-deepseek]\nmodel:\n  mtp: null\ntrain:\n  init_from: {bare}\n")
    assert _mtp(str(yaml_file), start) == (None, [])

    start = f"train.init_from={with_weights}"
    mtp, notes = _mtp("tiny-deepseek", start, "backend.name=megatron")  # TorchTitan builds no multi-token prediction
    assert mtp is not None and mtp.layers == 1 and notes == []
    assert _mtp("tiny-deepseek", start, "backend.name=megatron", "model.mtp=null") == (None, [])
    assert _mtp("tiny-deepseek", start, "backend.name=megatron", "model.mtp.loss_scale=0.3")[0].loss_scale == 0.3


@pytest.mark.parametrize(
    ("which", "override"),
    [("bare", "model.mtp.layers=1"), ("bare", "model.mtp.loss_scale=0.3"), ("with", "model.mtp.layers=2")],
)
def test_init_from_refuses_a_prediction_depth_the_folder_cannot_supply(hf_as_transformers_writes, which, override):
    from primus.core.launch.resolve import resolve

    folder = hf_as_transformers_writes[0 if which == "bare" else 1]
    with pytest.raises(ConfigError) as info:
        resolve("tiny-deepseek", [f"train.init_from={folder}", override], world_size=1, check_plugins=False)
    assert [i.path for i in info.value.issues] == ["model.mtp"]
    assert f"model.mtp: {folder}: the folder holds no weights of model.mtp's" in str(info.value)
    assert "set model.mtp=null" in str(info.value)
