"""The FP8 linear against an fp32 reference on CPU (torch 2.13 runs ``torch._scaled_mm`` on CPU, so these
are the real FP8 GEMMs; the Triton quantizer runs in the interpreter).

Bounds (relative Frobenius error vs fp32 ``x·Wᵀ`` and its grads, Gaussian inputs): quantizing both
operands to e4m3 (3 mantissa bits, relative rounding error ≤ 2⁻⁴, ~2.6% rms after two operands) stays
under 5%; a gradient in e5m2 (2 mantissa bits) under 8%.
"""

from __future__ import annotations

import pytest
import torch

from primus.turbo.fp8.linear import Float8Linear, Fp8State, convert_to_fp8, fp8_linear
from primus.turbo.fp8.quantize import dequantize, quantize, quantize_torch
from primus.turbo.fp8.recipe import Fp8Recipe

E4M3_BOUND, E5M2_BOUND = 0.05, 0.08
RECIPES = [
    Fp8Recipe(mode="tensorwise", grad_dtype="e5m2"),
    Fp8Recipe(mode="tensorwise", grad_dtype="e4m3"),
    Fp8Recipe(mode="tensorwise", grad_dtype="e5m2", scaling="delayed", amax_history=4),
    Fp8Recipe(mode="rowwise", grad_dtype="e5m2"),
    Fp8Recipe(mode="rowwise", grad_dtype="e4m3"),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(m=64, k=128, n=96, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) / k**0.5).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.mode}-{r.grad_dtype}-{r.scaling}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_both_grads_within_bounds(recipe, dtype):
    x, w, dy = inputs(dtype=dtype)
    y = fp8_linear(x, w, recipe=recipe, state=Fp8State(recipe.amax_history))
    y.backward(dy)
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    (xr @ wr.t()).backward(dy.float())
    grad_bound = E5M2_BOUND if recipe.grad_dtype == "e5m2" else E4M3_BOUND
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == torch.float32
    assert rel(y, xr @ wr.t()) < E4M3_BOUND
    assert rel(x.grad, xr.grad) < grad_bound
    assert rel(w.grad, wr.grad) < grad_bound
    # and the error is the quantization's, not zero: a test that could not fail would pass this too
    assert rel(y, xr @ wr.t()) > 1e-3


@pytest.mark.parametrize("mode", ["rowwise", "tensorwise"])
def test_triton_path_equals_the_torch_path(mode):
    """On a GPU the linear quantizes each operand once into both layouts its GEMMs take (Triton, here the
    interpreter) and keeps xᵀ in fp8; the PyTorch path transposes copies and quantizes each. The bytes are equal but
    where a value lands within an ulp of a rounding tie (torch's ``fp8_max / amax`` against the kernel's), so they
    agree to FP8's rounding (a wrong layout or scale is off by order 1). Shapes span several tiles and split the
    amax pass's columns."""
    recipe = Fp8Recipe(mode=mode)
    for dtype, tol in ((torch.float32, 0.01), (torch.bfloat16, 0.02)):
        x0, w0, dy = inputs(m=160, k=272, n=144, dtype=dtype, seed=3)
        out = {}
        for impl in ("torch", "triton"):
            x, w = x0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()
            y = fp8_linear(x, w, recipe=recipe, impl=impl)
            y.backward(dy)
            out[impl] = (y, x.grad, w.grad)
        for got, ref in zip(out["triton"], out["torch"], strict=True):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert rel(got, ref) <= tol, (dtype, rel(got, ref))


@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_equals_dequantized_fp32_matmul(rowwise):
    """The emulation identity: the FP8 GEMM is the fp32 product of the dequantized operands."""
    x, w, _ = inputs()
    recipe = Fp8Recipe(mode="rowwise" if rowwise else "tensorwise")
    xq, wq = quantize(x.detach(), "e4m3", rowwise=rowwise), quantize(w.detach(), "e4m3", rowwise=rowwise)
    emulated = dequantize(xq) @ dequantize(wq).t()
    bound = 1e-2 if rowwise else 1e-5  # rowwise: the GEMM output is rounded to bf16
    assert rel(fp8_linear(x.detach(), w.detach(), recipe=recipe), emulated) < bound


@pytest.mark.parametrize("fmt,bound", [("e4m3", 2**-4), ("e5m2", 2**-3)])
@pytest.mark.parametrize("rowwise", [False, True])
def test_quantize_scales_and_rounding(fmt, bound, rowwise):
    x = torch.randn(32, 256) * torch.logspace(-2, 2, 32)[:, None]
    q = quantize_torch(x, fmt, rowwise=rowwise)
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    torch.testing.assert_close(q.scale_inv, amax / (448.0 if fmt == "e4m3" else 57344.0))
    big = x.abs() > amax * 2**-6  # well inside the normal fp8 range
    assert ((dequantize(q) - x).abs()[big] <= bound * x.abs()[big] * 1.0001).all()  # half of a 2^-3 / 2^-2 ulp


def test_zero_input_stays_zero():
    y = fp8_linear(torch.zeros(16, 32), torch.randn(16, 32), recipe=Fp8Recipe())
    assert torch.equal(y, torch.zeros(16, 16))


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_input_is_never_a_finite_result(mode, bad):
    """Decided behaviour: inf/NaN anywhere in an operand makes the products that use its scale NaN."""
    x, w, dy = inputs()
    x.data[3, 5] = bad
    y = fp8_linear(x, w, recipe=Fp8Recipe(mode=mode))
    assert torch.isnan(y[3]).all()  # the row with the bad value
    if mode == "tensorwise":
        assert torch.isnan(y).all()
    y2 = fp8_linear(x.detach()[4:5], w, recipe=Fp8Recipe(mode=mode))
    assert torch.isfinite(y2).all()  # a clean input stays clean
    x2, w2, dy2 = inputs()
    dy2[0, 0] = bad
    fp8_linear(x2, w2, recipe=Fp8Recipe(mode=mode)).backward(dy2)
    assert torch.isnan(w2.grad).any() and torch.isnan(x2.grad[0]).all()


def test_delayed_scaling_uses_the_history():
    recipe = Fp8Recipe(scaling="delayed", amax_history=3)
    state, w = Fp8State(3), torch.randn(16, 32)
    x = torch.randn(8, 32)
    fp8_linear(x * 4, w, recipe=recipe, state=state)  # amax ~4x
    assert state.history["x"][0] == (x * 4).abs().amax()
    # next step, a smaller x: scaled by the history's max, so it uses only a quarter of the fp8 range
    scale_amax = state.scale_amax("x", x.device)
    q = quantize_torch(x, "e4m3", rowwise=False, amax=scale_amax)
    assert q.data.float().abs().max() <= 448 / 4 * 1.07
    for _ in range(2):
        fp8_linear(x, w, recipe=recipe, state=state)
        assert state.history["x"].amax() == (x * 4).abs().amax()  # the large step is still within the last 3
    fp8_linear(x, w, recipe=recipe, state=state)
    assert torch.allclose(state.history["x"], x.abs().amax().expand(3))  # ...and now it has left


def test_float8_linear_module_keeps_state_dict_and_skips():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16, bias=False))
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    swapped = convert_to_fp8(model, Fp8Recipe(scaling="delayed"), skip={"2"})
    assert swapped == ["0"] and type(model[0]) is Float8Linear and type(model[2]) is torch.nn.Linear
    model(torch.randn(4, 32)).sum().backward()
    assert model[0].fp8_state.history  # delayed state made on first use...
    assert model.state_dict().keys() == keys.keys()  # ...and never in the state dict
    assert all(torch.equal(model.state_dict()[k], v) for k, v in keys.items())
    with pytest.raises(ValueError, match=r"linear '0'.*\(20, 64\) are not multiples of 16"):
        convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(20, 64)), Fp8Recipe())


def test_trains_a_small_mlp_like_fp32():
    torch.manual_seed(0)
    data, target = torch.randn(256, 32), torch.randn(256, 16)

    def run(fp8: bool) -> list[float]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        if fp8:
            convert_to_fp8(model, Fp8Recipe(mode="rowwise"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for _ in range(40):
            loss = torch.nn.functional.mse_loss(model(data), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    ref, fp8 = run(False), run(True)
    assert fp8[-1] < 0.8 * fp8[0]
    assert abs(fp8[-1] - ref[-1]) / ref[-1] < 0.05


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_compiled_linear_equals_eager_with_auto_as_on_cuda(monkeypatch, mode):
    """With ``auto`` made to behave as on CUDA (Triton in eager mode, PyTorch ops while compiling), a compiled
    forward + backward equals the eager PyTorch path bit for bit, and the eager Triton path to FP8's rounding (see
    test_triton_path_equals_the_torch_path); the Triton quantizers (wrapped to refuse fake tensors) only ever see
    real ones. (On the GPU, ``benchmarks/fp8_compile_check.py`` checks the same against fp32 for a compiled
    torchtitan model.)"""
    from torch._subclasses.fake_tensor import is_fake

    from primus.turbo.fp8 import quantize as qmod
    from primus.turbo.fp8 import triton_grouped, triton_quantize

    real = qmod.resolve_impl
    monkeypatch.setattr(
        qmod,
        "resolve_impl",
        lambda x, impl: ("torch" if torch.compiler.is_compiling() else "triton") if impl == "auto" else real(x, impl),
    )
    import primus.turbo.fp8.linear as lin

    monkeypatch.setattr(lin, "resolve_impl", qmod.resolve_impl)
    traced = []

    def refuse_fake(fn):
        def wrapped(t, *args, **kwargs):
            traced.append(is_fake(t))
            if is_fake(t):
                raise AssertionError("Triton quantizer called on a traced tensor")
            return fn(t, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(triton_quantize, "quantize", refuse_fake(triton_quantize.quantize))
    monkeypatch.setattr(triton_grouped, "quantize_experts", refuse_fake(triton_grouped.quantize_experts))
    torch._dynamo.reset()
    recipe = Fp8Recipe(mode=mode)
    grads = {}
    for run in ("eager", "torch", "compiled"):
        x, w, dy = inputs()
        if run == "compiled":
            y = torch.compile(lambda a, b: fp8_linear(a, b, recipe=recipe), fullgraph=True)(x, w)
        else:
            y = fp8_linear(x, w, recipe=recipe, impl="auto" if run == "eager" else "torch")
        y.backward(dy)
        grads[run] = (y.detach(), x.grad, w.grad)
        if run == "eager":
            assert traced and not any(traced)  # eager went through the Triton path
    for got, ref in zip(grads["compiled"], grads["torch"], strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for got, ref in zip(grads["compiled"], grads["eager"], strict=True):
        assert rel(got, ref) < 0.01


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_traced_gemm_has_no_same_dtype_copy(mode):
    """Dynamo's graph of ``_mm`` ends at the GEMM op when its output already has the wanted dtype. A same-dtype
    ``.to()`` there (a no-op in eager mode) is a traced output aliasing an intermediate, for which torch 2.11's
    dynamo routed the backward's gradient to the wrong slot (pytorch#180642): compiled block linears trained on
    zero gradients on the H200 until it was removed."""
    import primus.turbo.fp8.linear as lin

    rowwise = mode == "rowwise"
    a = quantize_torch(torch.randn(32, 16), "e4m3", rowwise=rowwise)
    b = quantize_torch(torch.randn(48, 16), "e4m3", rowwise=rowwise)

    def to_nodes(out_dtype):
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        mm = lambda ad, asi, bd, bsi: lin._mm(  # noqa: E731
            lin.Quantized(ad, asi, asi), lin.Quantized(bd, bsi, bsi), out_dtype, rowwise=rowwise, fast_accum=True
        )
        y = torch.compile(mm, backend=capture, fullgraph=True)(a.data, a.scale_inv, b.data, b.scale_inv)
        assert y.dtype == out_dtype
        return [n for g in graphs for n in g.graph.nodes if n.op == "call_method" and n.target == "to"]

    assert to_nodes(torch.bfloat16) == []
    assert len(to_nodes(torch.float32)) == (1 if rowwise else 0)  # rowwise GEMMs give bf16: cast after


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("fast_backward", [False, True])
def test_fast_accumulation_reaches_the_backward_gemms_only_when_asked(monkeypatch, mode, fast_backward):
    """The forward GEMM always accumulates fast (as torchao's and TE's recipes do); the two backward GEMMs promote
    partial sums to fp32 unless ``fast_accum_backward`` is set."""
    import primus.turbo.fp8.linear as lin

    seen = []
    real = lin.scaled_mm

    def recording(a, b, scale_a, scale_b, out_dtype, fast_accum, aiter=False):
        seen.append(fast_accum)
        return real(a, b, scale_a, scale_b, out_dtype, fast_accum, aiter)

    monkeypatch.setattr(lin, "scaled_mm", recording)
    x, w, dy = inputs()
    fp8_linear(x, w, recipe=Fp8Recipe(mode=mode, fast_accum_backward=fast_backward)).backward(dy)
    assert seen == [True, fast_backward, fast_backward]


def test_torchao_config_carries_the_recipe(monkeypatch):
    """float8_config against a stand-in with torchao 0.18's names and defaults (torchao is not installed here):
    gradient dtype, rowwise recipe, fast accumulation of the backward GEMMs, FP8 all-gather under FSDP."""
    import dataclasses
    import sys
    import types

    @dataclasses.dataclass(frozen=True)
    class CastConfig:
        target_dtype: object = None

    @dataclasses.dataclass(frozen=True)
    class Float8GemmConfig:
        use_fast_accum: bool = False

    @dataclasses.dataclass(frozen=True)
    class Float8LinearConfig:
        cast_config_grad_output: CastConfig = CastConfig()
        gemm_config_output: Float8GemmConfig = Float8GemmConfig(use_fast_accum=True)
        gemm_config_grad_input: Float8GemmConfig = Float8GemmConfig()
        gemm_config_grad_weight: Float8GemmConfig = Float8GemmConfig()
        enable_fsdp_float8_all_gather: bool = False
        recipe: str = "tensorwise"

        @staticmethod
        def from_recipe_name(name):
            return Float8LinearConfig(recipe=name)

    float8 = types.ModuleType("torchao.float8")
    float8.CastConfig, float8.Float8GemmConfig, float8.Float8LinearConfig = (
        CastConfig,
        Float8GemmConfig,
        Float8LinearConfig,
    )
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    from primus.turbo.fp8.torchao_backend import float8_config

    plain = float8_config(Fp8Recipe())
    assert plain.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert not plain.gemm_config_grad_input.use_fast_accum and not plain.gemm_config_grad_weight.use_fast_accum
    fast = float8_config(Fp8Recipe(fast_accum_backward=True))
    assert fast.gemm_config_grad_input.use_fast_accum and fast.gemm_config_grad_weight.use_fast_accum
    assert fast.gemm_config_output.use_fast_accum
    rowwise = float8_config(Fp8Recipe(mode="rowwise", grad_dtype="e4m3", fast_accum_backward=True))
    assert rowwise.recipe == "rowwise" and rowwise.gemm_config_grad_weight.use_fast_accum
    # FSDP2 all-gathers tensorwise weights in e4m3 where the engine says FSDP shards them
    assert float8_config(Fp8Recipe(fp8_all_gather=True)).enable_fsdp_float8_all_gather
    assert not plain.enable_fsdp_float8_all_gather
    with pytest.raises(ValueError, match="dynamic"):
        float8_config(Fp8Recipe(scaling="delayed"))
