"""Kernel providers swapped into torchtitan's modules.

In process: the swap keeps every parameter, state-dict key and output (with core's reference providers
it computes what torchtitan's modules compute), and a fake provider is called by every swapped module.
End to end (``primus train`` through drive.py): counting providers replace torchtitan's modules in
FSDP and TP runs (under TP the norms and the loss stay torchtitan's: DTensors), which reproduce the
losses of torchtitan's own modules; and at world size 1 primus-turbo's real Triton kernels (rms_norm,
swiglu, cross_entropy, run by Triton's interpreter on the CPU) with a counting attention reproduce them
too: the same loss with turbo on and off for the same seed.
"""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from conftest import TINY, drive, metrics, summary
from test_models import preset

from primus.core.contracts.protocols import Availability, KernelProvider
from primus.core.kernels import reference
from primus.torchtitan.kernels import ProviderAttention, ProviderRMSNorm, plan, provider_loss, swap_modules
from primus.torchtitan.loss import FusedOutput, head_loss, head_targets
from primus.torchtitan.models import base_train_spec, model_args


def provider(op: str, name: str, fn) -> KernelProvider:
    return KernelProvider(op, name, fn, lambda device, **_: Availability(True))


CORE = {
    "attention": provider("attention", "sdpa", reference.attention),
    "rms_norm": provider("rms_norm", "torch", reference.rms_norm),
    "swiglu": provider("swiglu", "torch", reference.swiglu),
    "cross_entropy": provider("cross_entropy", "torch", reference.cross_entropy),
    "rope": provider("rope", "torch", reference.rope),
}


def counting(calls: Counter) -> dict[str, KernelProvider]:
    def wrap(op):
        def impl(*args, **kwargs):
            calls[op] += 1
            return getattr(reference, op)(*args, **kwargs)

        return impl

    return {op: provider(op, "counting", wrap(op)) for op in ("attention", "rms_norm", "swiglu", "cross_entropy")}


def tiny_model(name: str = "tiny-llama") -> torch.nn.Module:
    m = preset(name)
    torch.manual_seed(0)
    model = base_train_spec(m).model_cls(model_args(m, 32))
    with torch.no_grad():
        model.init_weights()
    return model


@pytest.mark.parametrize(("name", "norms"), [("tiny-llama", 5), ("tiny-qwen3", 9), ("tiny-qwen2", 5)])
def test_swap_keeps_parameters_and_outputs(name, norms):
    model = tiny_model(name)
    swapped = copy.deepcopy(model)
    params = dict(swapped.named_parameters())
    counts = swap_modules(
        swapped, plan(CORE, family=preset(name).family, tp=1, cp=1, loss_parallel=True, swap_reference=True)
    )
    assert counts == {"attention": 2, "rms_norm": norms, "swiglu": 2}  # qwen3: q/k norms too
    assert all(p is params[n] for n, p in swapped.named_parameters())  # the same Parameter objects
    assert list(swapped.state_dict()) == list(model.state_dict())
    assert isinstance(swapped.norm, ProviderRMSNorm) and isinstance(swapped.norm, torch.nn.RMSNorm)
    assert isinstance(swapped.layers["0"].attention.inner_attention, ProviderAttention)
    tokens = torch.randint(0, 2048, (2, 32))
    want, got = model(tokens), swapped(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().mean().backward()
    want.square().mean().backward()
    for (n, a), b in zip(swapped.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_every_swapped_module_calls_the_provider():
    calls: Counter = Counter()
    model = tiny_model()
    swap_modules(model, plan(counting(calls), family="llama", tp=1, cp=1, loss_parallel=True))
    model(torch.randint(0, 2048, (1, 16)))
    assert calls == {"rms_norm": 5, "attention": 2, "swiglu": 2}


def test_reference_providers_stay_torchtitan_modules_and_rope_is_never_swapped():
    choices = plan(CORE, family="llama", tp=1, cp=1, loss_parallel=True)
    assert all(c.fn is None for c in choices.values())
    assert "same" in choices["rms_norm"].note and "interleaved" in choices["rope"].note
    assert "inline" in plan(CORE, family="qwen3", tp=1, cp=1, loss_parallel=True)["rope"].note


def test_dtensor_ops_are_left_to_torchtitan_under_tp():
    fake = counting(Counter())
    tp = plan(fake, family="llama", tp=2, cp=1, loss_parallel=True)
    assert tp["rms_norm"].fn is None and "DTensor" in tp["rms_norm"].note
    assert tp["cross_entropy"].fn is None and "loss parallelism" in tp["cross_entropy"].note
    assert tp["attention"].fn is not None and tp["swiglu"].fn is not None  # local tensors under TP
    assert plan(fake, family="llama", tp=2, cp=1, loss_parallel=False)["cross_entropy"].fn is not None
    # qwen3 hands its attention DTensors sharded by head under TP: the provider runs on each rank's heads
    qwen3 = plan(fake, family="qwen3", tp=2, cp=1, loss_parallel=True)["attention"]
    assert qwen3.fn is not None and qwen3.heads_sharded
    assert plan(CORE, family="qwen3", tp=2, cp=1, loss_parallel=True)["attention"].fn is reference.attention


def test_context_parallel_attention_is_the_providers_entry_point():
    """Under cp > 1 a provider with a context-parallel entry point is swapped in as ContextParallelAttention (on
    torchtitan's sequence shards); one without leaves torchtitan's module to torch's context-parallel SDPA."""
    from primus.torchtitan.kernels import ContextParallelAttention

    fake = counting(Counter())
    plain = plan(fake, family="llama", tp=1, cp=2, loss_parallel=True)["attention"]
    assert plain.fn is None and "torch's context-parallel SDPA" in plain.note

    def attention(q, k, v, *, causal=True, scale=None):
        raise AssertionError("the whole-sequence entry point must not run under cp > 1")

    def entry(q, k, v, *, group, causal=True, scale=None):
        return q

    attention.context_parallel = entry
    ring = dict(fake, attention=provider("attention", "ring", attention))
    choices = plan(ring, family="llama", tp=1, cp=2, loss_parallel=True)
    assert choices["attention"].fn is entry and choices["attention"].context_parallel
    model = tiny_model()
    counts = swap_modules(model, choices)
    inner = [m for m in model.modules() if type(m) is ContextParallelAttention]
    assert counts["attention"] == len(inner) == 2
    with pytest.raises(RuntimeError, match="DTensors sharded over the cp mesh"):
        inner[0](torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))
    # qwen3 under TP hands DTensors of the TP mesh to its attention: torchtitan's module stays
    assert plan(ring, family="qwen3", tp=2, cp=2, loss_parallel=True)["attention"].fn is None


def test_provider_loss_is_torchtitans_token_sum():
    from torchtitan.components.loss import cross_entropy_loss

    pred = torch.randn(2, 8, 50, requires_grad=True)
    labels = torch.randint(0, 50, (2, 8))
    labels[0, :3] = -100
    loss = provider_loss(reference.cross_entropy)
    torch.testing.assert_close(loss(pred, labels), cross_entropy_loss(pred, labels))
    empty = loss(pred, torch.full_like(labels, -100))
    empty.backward()
    assert empty.item() == 0 and torch.equal(pred.grad, torch.zeros_like(pred.grad))


def fused_reference(hidden, weight, target, ignore_index=-100):
    """Core's reference loss on the logits: what a provider's fused linear + cross-entropy computes."""
    return reference.cross_entropy(hidden @ weight.T, target, ignore_index)


def offering_fused() -> dict[str, KernelProvider]:
    """Core's providers, with a cross_entropy that offers a fused ``linear_cross_entropy``."""

    def cross_entropy(logits, target, ignore_index=-100):
        return reference.cross_entropy(logits, target, ignore_index)

    cross_entropy.linear_cross_entropy = fused_reference
    return {**CORE, "cross_entropy": provider("cross_entropy", "fused", cross_entropy)}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen2"])  # tiny-qwen2: tied embeddings
def test_fused_head_gives_torchtitans_loss_and_gradients(name):
    from torchtitan.components.loss import cross_entropy_loss

    model = tiny_model(name)
    fused = copy.deepcopy(model)
    params = dict(fused.named_parameters())
    choices = plan(offering_fused(), family=preset(name).family, tp=1, cp=1, loss_parallel=True)
    assert choices["linear_cross_entropy"].fn is fused_reference
    assert swap_modules(fused, choices) == {"linear_cross_entropy": 1}  # core's modules stay torchtitan's
    assert isinstance(fused.output, FusedOutput) and isinstance(fused.output, torch.nn.Linear)
    assert all(p is params[n] for n, p in fused.named_parameters())
    assert list(fused.state_dict()) == list(model.state_dict())
    tokens = torch.randint(0, 2048, (2, 32))
    labels = torch.randint(0, 2048, (2, 32))
    labels[0, :5] = -100
    torch.testing.assert_close(fused(tokens), model(tokens))  # without labels: the plain projection
    want = cross_entropy_loss(model(tokens), labels)
    with head_targets([fused], labels):
        got = head_loss(cross_entropy_loss)(fused(tokens), labels)
    assert fused.output.labels is None  # handed back after the forward
    assert got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.backward()
    want.backward()
    for (n, a), b in zip(fused.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_fused_head_is_refused_where_the_output_is_sharded_or_the_loss_is_outside_its_forward():
    fake = offering_fused()
    notes = {
        "tp": plan(fake, family="llama", tp=2, cp=1, loss_parallel=False)["linear_cross_entropy"],
        "pp": plan(fake, family="llama", tp=1, cp=1, pp=2, loss_parallel=True)["linear_cross_entropy"],
        "cp": plan(fake, family="llama", tp=1, cp=2, loss_parallel=True)["linear_cross_entropy"],
        "fp8": plan(fake, family="llama", tp=1, cp=1, loss_parallel=True, fp8_head=True)["linear_cross_entropy"],
    }
    assert all(c.fn is None for c in notes.values())
    assert "FP8 linear" in notes["fp8"].note
    assert "vocab-sharded" in notes["tp"].note and "pipeline" in notes["pp"].note and "context" in notes["cp"].note
    assert "linear_cross_entropy" not in plan(CORE, family="llama", tp=1, cp=1, loss_parallel=True)


# ------------------------------------------------------------------------------------------------ end to end

# layout -> (processes, overrides, per rank: op -> provider calls over the run of 2 steps)
# per forward of the 2-layer model: attention and swiglu 2 calls, norms 5, loss 1; 2 steps of a global
# batch of 4 in micro-batches of 2: 2 forwards per rank with FSDP over 2, 4 with TP or PP (world size 1:
# see the turbo test, which counts attention)
COUNTING_LAYOUTS = {
    "fsdp2": (2, ["parallel.dp_shard=2"], [{"attention": 4, "swiglu": 4, "rms_norm": 10, "cross_entropy": 2}] * 2),
    # norms and the loss run on DTensors under TP: torchtitan's own modules
    "tp2": (2, ["parallel.tp=2"], [{"attention": 8, "swiglu": 8}] * 2),
    # swapped per stage: layer 0 on rank 0; layer 1, the final norm and the loss on rank 1; 4 forwards
    # plus one of torch's pipeline metadata inference (each stage's forward and loss, once before step 1)
    "pp2": (
        2,
        ["parallel.pp=2"],
        [
            {"attention": 5, "swiglu": 5, "rms_norm": 10},
            {"attention": 5, "swiglu": 5, "rms_norm": 15, "cross_entropy": 5},
        ],
    ),
}


@pytest.mark.parametrize("layout", list(COUNTING_LAYOUTS))
def test_counting_providers_run_and_match_torchtitans_modules(layout, tmp_path, reference, seed_checkpoint):
    nproc, overrides, want = COUNTING_LAYOUTS[layout]
    kernels = [f"kernels.{op}=counting" for op in ("attention", "rms_norm", "swiglu", "cross_entropy")]
    if layout == "tp2":
        kernels = ["kernels.attention=counting", "kernels.swiglu=counting"]  # explicit DTensor ops are refused
    ref = metrics(reference(()))[:2]
    counts = tmp_path / "calls.json"
    drive(
        TINY,
        tmp_path,
        *overrides,
        *kernels,
        "train.steps=2",
        "checkpoint.enabled=false",
        "train.schedule.decay_steps=8",
        f"train.init_from={seed_checkpoint()}",
        env={"PRIMUS_TEST_COUNTING": str(counts)},
        nproc=nproc,
    )
    assert [json.loads((tmp_path / f"calls.json.{r}").read_text()) for r in range(nproc)] == want
    got = metrics(tmp_path)
    # as tests/test_train.py's layouts
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-3)


def test_turbo_triton_kernels_give_the_same_loss(tmp_path, reference, seed_checkpoint):
    """primus-turbo's Triton rms_norm, swiglu and fused output projection + cross_entropy (Triton's
    interpreter on the CPU, fp32) against torchtitan's own modules (turbo off), same seed checkpoint and
    data: losses within 1e-5 (relative), grad norms within 1e-4.
    Attention (turbo has no CPU-runnable one) is the counting provider: swapped in at world size 1 too."""
    ref = metrics(reference(()))[:2]
    counts = tmp_path / "calls.json"
    proc = drive(
        TINY,
        tmp_path,
        "kernels.attention=counting",
        "kernels.rms_norm=triton",
        "kernels.swiglu=triton",
        "kernels.cross_entropy=triton",
        "train.steps=2",
        "checkpoint.enabled=false",
        "train.schedule.decay_steps=8",
        f"train.init_from={seed_checkpoint()}",
        env={"PRIMUS_TEST_TRITON_ON_CPU": "1", "TRITON_INTERPRET": "1", "PRIMUS_TEST_COUNTING": str(counts)},
    )
    assert json.loads((tmp_path / "calls.json.0").read_text()) == {
        "attention": 8
    }  # 2 layers x 2 micro-batches x 2 steps
    applied = summary(proc)["kernels"]
    assert applied == {
        "attention": "counting",
        "rms_norm": "triton",
        "swiglu": "triton",
        "cross_entropy": "triton",
        "linear_cross_entropy": "triton",  # the output projection + loss: one fused call
        "rope": "torchtitan",  # layouts differ: never swapped
    }
    got = metrics(tmp_path)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)
