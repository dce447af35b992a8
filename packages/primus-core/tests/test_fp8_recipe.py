"""kernels.fp8_recipe: the config section becomes the GEMM recipe the FP8 providers run, every field carried."""

from __future__ import annotations

import dataclasses

import pytest

from primus.core.config.schema import PrimusConfig
from primus.core.kernels.fp8_recipe import Fp8Recipe, config_issues


def test_recipe_carries_every_gemm_setting_from_the_config():
    kernels = PrimusConfig.model_validate(
        {
            "kernels": {
                "fp8": "tensorwise",
                "fp8_recipe": {
                    "grad_dtype": "e4m3",
                    "scaling": "delayed",
                    "amax_history": 4,
                    "fast_accum_backward": True,
                },
            }
        }
    ).kernels
    recipe = Fp8Recipe.from_config(kernels)
    assert recipe == Fp8Recipe("tensorwise", "e4m3", "delayed", 4, fast_accum_backward=True)
    # every recipe field is a config field of the same name (mode is kernels.fp8 itself; the run fields are not)
    names = {f.name for f in dataclasses.fields(Fp8Recipe)} - {"mode", *Fp8Recipe.RUN_FIELDS}
    assert names <= set(type(kernels.fp8_recipe).model_fields) and "rocm_gemm" in names
    assert Fp8Recipe.from_config(PrimusConfig().kernels) is None  # fp8 off
    assert not recipe.fnuz and (recipe.forward_format, recipe.grad_format) == ("e4m3", "e4m3")
    assert not recipe.fp8_all_gather


def test_fnuz_formats_are_the_mi300_ones():
    from primus.core.kernels.fp8_recipe import FP8_MAX

    r = Fp8Recipe(fnuz=True)
    assert (r.forward_format, r.grad_format) == ("e4m3fnuz", "e5m2fnuz")
    assert FP8_MAX[r.forward_format] == 240.0 and FP8_MAX["e4m3"] == 448.0  # fnuz's exponent bias is one higher
    with pytest.raises(ValueError, match="rocm_gemm"):
        Fp8Recipe(rocm_gemm="rocblas")


def test_delayed_scaling_is_refused_under_compile():
    cfg = PrimusConfig.model_validate(
        {
            "train": {"precision": "bf16", "compile": True},
            "kernels": {"fp8": "tensorwise", "fp8_recipe": {"scaling": "delayed"}},
        }
    )
    (issue,) = config_issues(cfg, engine="torchtitan")
    assert issue.path == "kernels.fp8_recipe.scaling" and "torch.compile" in issue.message
    eager = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})})
    assert config_issues(eager, engine="torchtitan") == []


def test_mixture_of_experts_refusals_name_the_key():
    """FP8 experts run on the FP8 provider's grouped GEMM: current scaling, primus-turbo's provider, expert widths
    that are multiples of 16."""
    base = {"train": {"precision": "bf16"}, "model": {"moe": {"num_experts": 4}}}
    assert config_issues(PrimusConfig.model_validate({**base, "kernels": {"fp8": "rowwise"}}), engine="e") == []
    bad = PrimusConfig.model_validate(
        {
            "train": {"precision": "bf16"},
            "model": {"moe": {"num_experts": 4, "expert_ffn_hidden_size": 72}},
            "kernels": {"fp8": "tensorwise", "fp8_recipe": {"scaling": "delayed", "implementation": "torchao"}},
        }
    )
    issues = {i.path: i for i in config_issues(bad, engine="e") if "expert" in i.message}
    assert set(issues) == {"kernels.fp8", "kernels.fp8_recipe.scaling", "kernels.fp8_recipe.implementation"}
    assert "expert_ffn_hidden_size" in issues["kernels.fp8"].message and "72" in issues["kernels.fp8"].message
    assert issues["kernels.fp8_recipe.scaling"].value == "delayed"
    assert "no grouped GEMM" in issues["kernels.fp8_recipe.implementation"].message


def test_the_linears_rule_follows_the_measured_bound():
    """``fp8_recipe.linears: auto``: eager, FP8 from a per-rank weight of 4096 x 4096 (Llama 8B's q/o measured 1.06x
    rowwise on an H100, 3B's 3072 x 3072 1.03x, 1B's q/o 0.83x); compiled, every linear; ``all``, every linear."""
    from primus.core.config.schema import KernelsConfig
    from primus.core.kernels.fp8_recipe import FP8_MIN_WEIGHT_EAGER, fp8_linear_rule, fp8_linears_note

    auto, every = KernelsConfig(fp8="rowwise"), KernelsConfig(fp8="rowwise", fp8_recipe={"linears": "all"})
    assert FP8_MIN_WEIGHT_EAGER == 4096 * 4096
    eager = fp8_linear_rule(auto, compiled=False)
    assert eager(4096, 4096) and eager(2048, 8192) and eager(4096, 28672) and eager(8192, 8192)
    assert not eager(3072, 3072) and not eager(4096, 1024) and not eager(2048, 3072)
    assert fp8_linear_rule(auto, compiled=True)(64, 64) and fp8_linear_rule(every, compiled=False)(64, 64)
    assert "3 of 7 linears stay bf16" in fp8_linears_note(3, 7) and "16,777,216" in fp8_linears_note(3, 7)


def test_the_planner_counts_only_the_linears_the_rule_puts_in_fp8():
    """Eager with ``linears: auto``: Llama 1B's MLP in FP8 (2048 x 8192 reaches 4096²), not its attention, and under
    TP 2 none (each rank's share is under the bound); Llama 70B's every linear but k and v (8192 x 1024 each), which
    an engine that runs q, k, v as one GEMM (megatron's qkv) puts in FP8 too, and under TP 8 its MLP alone;
    compiled, every one."""
    from primus.core.config.loader import load_layers
    from primus.core.config.presets import resolver
    from primus.core.config.schema import ModelConfig
    from primus.core.contracts.plugins import get_registry
    from primus.core.planner.memory import KernelTerms

    def model_of(preset: str) -> ModelConfig:  # the preset's model section alone (core's tests run with no engine)
        return ModelConfig.model_validate(load_layers(preset, [], resolver(get_registry())).data["model"])

    def share(preset: str, tp: int = 1, groups: dict | None = None, **terms) -> float:
        return KernelTerms(fp8="rowwise", fp8_linears="auto", **terms).fp8_share(
            model_of(preset), tp, 1, None, groups or {}
        )

    one_gemm = {"qkv": ("q", "k", "v"), "fc1": ("gate", "up")}  # an engine's GEMM groups (megatron's)

    assert 0.8 < share("llama3.2-1b") < 0.9 and share("llama3.2-1b", tp=2) == 0.0
    assert share("llama3.2-1b", compiled=True) == 1.0
    assert 0.97 < share("llama3.1-70b") < 1.0 and share("llama3.1-70b", groups=one_gemm) == 1.0
    assert 0.8 < share("llama3.1-70b", tp=8) < 0.9 and 0.8 < share("llama3.1-70b", tp=8, groups=one_gemm) < 0.9
    assert KernelTerms(fp8="rowwise").fp8_share(model_of("llama3.2-1b")) == 1.0
    # a mixture of experts: eager auto leaves Qwen3-30B-A3B's attention (q 2048 x 4096) bf16 and core's experts rule
    # its routed experts (no device measures FP8 grouped GEMMs faster), so nothing is FP8, as its GPU runs show;
    # forced, the experts are nearly all of a layer's parameters, fewer of a device's under EP
    assert share("qwen3-30b-a3b") == 0.0
    forced = share("qwen3-30b-a3b", fp8_experts=True)
    assert 0.95 < forced < 1.0 and share("qwen3-30b-a3b", fp8_experts=True, compiled=True) == 1.0
    moe = model_of("qwen3-30b-a3b")
    assert KernelTerms(fp8="rowwise", fp8_linears="auto", fp8_experts=True).fp8_share(moe, ep=8) < forced
    # latent attention by its own linears: DeepSeek-V3's q_b, kv_b (512 x 32768, just 4096²) and o reach the bound,
    # its down projections q_a / kv_a and its shared expert (7168 x 2048) do not; under TP the down projections
    # stay whole on every rank, and bf16
    v3 = model_of("deepseek-v3")
    dense = share("deepseek-v3")
    assert 0.0 < dense < 0.05  # the routed experts (bf16) are nearly all of a layer
    assert share("deepseek-v3", fp8_experts=True, compiled=True) == 1.0
    assert 0.99 < share("deepseek-v3", fp8_experts=True, compiled=True, tp=2) < 1.0
    assert KernelTerms(fp8="rowwise", fp8_linears="all").fp8_share(v3) > dense


def test_the_eager_rule_weighs_a_calls_work_tokens_times_weight():
    """The 4096² bound was measured at 8192 tokens a call: at 4096 (a micro-batch of 1 at seq 4096) Moonlight's dense
    MLP (2048 x 11264, over 4096²) stays bf16, as its run measured FP8 slower (0.95-0.99x on an H200); twice the
    tokens admit a weight half the size (Llama 3B's q/o, 3072²); the planner and a run's config take the same."""
    from primus.core.config.schema import PrimusConfig
    from primus.core.kernels.fp8_recipe import FP8_RULE_TOKENS, fp8_linear_pays, gemm_tokens

    assert FP8_RULE_TOKENS == 8192 and fp8_linear_pays(4096, 4096, compiled=False)  # the default: the measured case
    assert fp8_linear_pays(2048, 11264, compiled=False) and not fp8_linear_pays(
        2048, 11264, compiled=False, tokens=4096
    )
    assert not fp8_linear_pays(3072, 3072, compiled=False) and fp8_linear_pays(3072, 3072, compiled=False, tokens=16384)
    assert fp8_linear_pays(2048, 11264, compiled=True, tokens=1)  # compiled: every linear
    cfg = PrimusConfig.model_validate({"train": {"seq_len": 4096, "micro_batch_size": 2}, "parallel": {"cp": 2}})
    assert gemm_tokens(cfg) == 4096  # a micro-batch's sequence split over the context-parallel ranks

    from primus.core.planner.memory import KernelTerms

    terms = KernelTerms(fp8="rowwise", fp8_linears="auto")
    m = PrimusConfig.model_validate({"model": {"hidden_size": 2048, "ffn_hidden_size": 11264}}).model
    assert terms.fp8_share(m, tokens=8192) > 0.5 and terms.fp8_share(m, tokens=4096) == 0.0
