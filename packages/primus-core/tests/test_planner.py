"""The planner: its memory and step-time formulas, the search and the strategies that use them.

Core's machinery, on engines whose facts these tests give (:data:`GENERIC`, core's own, and :data:`ENGINE`): the
same whatever backends are installed. Megatron's and TorchTitan's facts (their state bytes, recompute, fused loss and
the layouts the planner picks with them) are tested where they are installed: primus-megatron's
tests/test_megatron_planner_facts.py, primus-torchtitan's tests/test_torchtitan_planner_facts.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.config.presets import model_config
from primus.core.planner import GENERIC, Cluster, EngineProfile, KernelTerms, Layout, device, estimate
from primus.core.planner.modelmath import count_params
from primus.core.planner.strategies import fused_loss

# An engine of these tests' own: fp32 weights that are their own master copy (the optimizer keeps Adam's m, v only),
# trained under torch.autocast where FSDP does not cast them; no distributed optimizer; selective recompute keeps
# half of a layer's activations. The rest is GENERIC's: fp32 gradients on the wire, no fused loss under PP or CP
# (nor under TP, core's rule for every engine).
ENGINE = EngineProfile(
    name="engine", distributed_optimizer=False, weight_bytes=4, master_bytes=0, autocast=True, selective_kept=0.5
)


def _on(profile: EngineProfile, dp_mode: str, dp: int, **dims) -> Layout:
    """A layout of ``profile``'s engine (its facts given, not looked up among the installed backends)."""
    return Layout(profile.name, dp_mode, dp, profile=profile, **dims)


def _model(registry, name):
    return model_config(name, registry)


def test_state_bytes_per_parameter(registry):
    m = _model(registry, "qwen2.5-7b")
    p = count_params(m).total
    ddp = estimate(m, _on(GENERIC, "ddp", dp=8), 4096).parts
    dist = estimate(m, _on(GENERIC, "ddp_distopt", dp=8), 4096).parts
    fsdp = estimate(m, _on(GENERIC, "fsdp", dp=8), 4096).parts
    fsdp_fp32 = estimate(m, _on(ENGINE, "fsdp", dp=8), 4096).parts
    distopt_fp32 = estimate(m, _on(ENGINE, "ddp_distopt", dp=8), 4096).parts
    assert (ddp["weights"], ddp["gradients"], ddp["optimizer"]) == (2 * p, 4 * p, 12 * p)
    assert dist["optimizer"] == pytest.approx(12 * p / 8) and dist["gradients"] == 4 * p
    assert (fsdp["weights"], fsdp["gradients"], fsdp["optimizer"]) == tuple(
        pytest.approx(b * p / 8) for b in (2, 4, 12)
    )
    assert (fsdp_fp32["weights"], fsdp_fp32["optimizer"]) == (pytest.approx(4 * p / 8), pytest.approx(8 * p / 8))
    assert distopt_fp32["optimizer"] == 8 * p  # an engine without a distributed optimizer keeps Adam's state whole


def test_activation_memory_orders(registry):
    m = _model(registry, "llama3.1-8b")
    act = {
        rc: estimate(m, _on(GENERIC, "ddp", dp=1, recompute=rc), 8192).parts["activations"]
        for rc in ("none", "selective", "full")
    }
    assert act["full"] < act["selective"] == act["none"]  # the generic engine's selective frees nothing
    half = {
        rc: estimate(m, _on(ENGINE, "fsdp", dp=8, recompute=rc), 8192).parts["activations"]
        for rc in ("none", "selective", "full")
    }
    assert half["full"] < half["selective"] < half["none"]
    # Llama 8B at seq 8192, bf16, one sample: 2·s·(6d + 2·kv·c + 3f) bytes per layer
    assert act["none"] == pytest.approx(32 * 2 * 8192 * (6 * 4096 + 2 * 8 * 128 + 3 * 14336))
    tp = estimate(m, _on(GENERIC, "ddp", dp=1, tp=4), 8192).parts["activations"]
    assert tp == pytest.approx(act["none"] / 4)  # sequence parallel shards all of it
    pp = estimate(m, _on(GENERIC, "ddp", dp=1, pp=4, micro_batches=8), 8192).parts["activations"]
    assert pp == pytest.approx(act["none"] / 4 * 4)  # a quarter of the layers, 4 micro-batches in flight
    vpp = estimate(m, _on(GENERIC, "ddp", dp=1, pp=4, vpp=2, micro_batches=8), 8192).parts["activations"]
    assert vpp == pytest.approx(pp * (1 + 3 / 8))  # Megatron's interleaving penalty


def test_nothing_fits_is_refused_with_numbers():
    res = CliRunner().invoke(cli.app, ["plan", "--preset", "llama3.1-405b", "--device", "H100", "train.seq_len=8192"])
    assert res.exit_code == 3
    assert "nothing fits" in res.output and "GiB per GPU" in res.output and "71.3 GiB usable" in res.output


def test_plan_cli_recommends():
    res = CliRunner().invoke(
        cli.app,
        [
            "plan",
            "--preset",
            "qwen2.5-7b",
            "--device",
            "MI300X",
            "--engine",
            "megatron",
            "train.seq_len=4096",
            "train.micro_batch_size=1",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "recommended: DDP+distopt 8, no recompute" in res.output
    assert "optimizer" in res.output and "activations" in res.output


def test_strategy_auto_fills_the_parallel_section(registry, monkeypatch):
    from primus.core.launch.resolve import resolve
    from primus.core.planner import auto

    monkeypatch.setattr(auto, "local_device", lambda: device("H100"))
    res = resolve(
        "llama3.1-8b",
        ["backend.name=fake", "parallel.strategy=auto", "train.seq_len=8192", "train.micro_batch_size=1"],
        world_size=8,
        registry=registry,
    )
    p = res.config.parallel
    assert p.dp_replicate * p.dp_shard * p.tp * p.pp == 8 and p.strategy == "auto"
    kept = resolve(
        "llama3.1-8b",
        [
            "backend.name=fake",
            "parallel.strategy=auto",
            "parallel.tp=2",
            "train.seq_len=8192",
            "train.micro_batch_size=1",
        ],
        world_size=8,
        registry=registry,
    )
    assert kept.config.parallel.tp == 2 and kept.config.parallel.sequence_parallel  # the user's tp is kept


def test_strategy_auto_refuses_what_cannot_fit(registry, monkeypatch):
    from primus.core.config.errors import ConfigError
    from primus.core.launch.resolve import resolve
    from primus.core.planner import auto

    monkeypatch.setattr(auto, "local_device", lambda: device("H100"))
    with pytest.raises(ConfigError, match="parallel.strategy: auto: no layout fits 8 × H100"):
        resolve(
            "llama3.1-405b",
            ["backend.name=fake", "parallel.strategy=auto", "train.seq_len=8192"],
            world_size=8,
            registry=registry,
        )


def test_named_strategy_fills_and_keeps_explicit_sizes(registry):
    from primus.core.launch.resolve import resolve

    ddp = resolve("tiny-llama", ["backend.name=fake", "parallel.strategy=ddp"], world_size=4, registry=registry)
    p = ddp.config.parallel
    assert (p.dp_replicate, p.dp_shard, p.distributed_optimizer) == (4, 1, True)
    mine = resolve(
        "tiny-llama",
        ["backend.name=fake", "parallel.strategy=ddp", "parallel.tp=2", "parallel.distributed_optimizer=false"],
        world_size=4,
        registry=registry,
    )
    p = mine.config.parallel
    assert (p.dp_replicate, p.dp_shard, p.tp, p.distributed_optimizer) == (2, 1, 2, False)
    fsdp = resolve("tiny-llama", ["backend.name=fake", "parallel.strategy=fsdp2"], world_size=4, registry=registry)
    assert (fsdp.config.parallel.dp_shard, fsdp.config.parallel.dp_replicate) == (4, 1)


def test_strategy_estimate_is_the_planners_model(registry):
    from primus.core.contracts.protocols import load_ref
    from primus.core.launch.resolve import resolve

    res = resolve(
        "llama3.1-8b",
        ["backend.name=fake", "parallel.strategy=ddp", "train.seq_len=4096", "train.micro_batch_size=1"],
        world_size=8,
        registry=registry,
    )
    est = load_ref(registry.strategies["ddp"].estimate)(res.config, 8)
    want = estimate(
        res.config.model,
        Layout("fake", "ddp_distopt", dp=8, profile=GENERIC),  # the fake backend names no profile: the generic one
        4096,
        kernels=KernelTerms(fused_loss=fused_loss(res.config)),
    )
    assert est.parts == want.parts and est.total == pytest.approx(want.total)


def test_auto_refusal_gives_the_numbers(registry, monkeypatch):
    from primus.core.config.errors import ConfigError
    from primus.core.launch.resolve import resolve
    from primus.core.planner import auto

    monkeypatch.setattr(auto, "local_device", lambda: device("H100"))
    with pytest.raises(ConfigError, match=r"71\.3 usable.*the smallest \(.*\) needs \d+\.\d GiB per device"):
        resolve(
            "llama3.1-405b",
            ["backend.name=fake", "parallel.strategy=auto", "train.seq_len=8192"],
            world_size=8,
            registry=registry,
        )


def test_a_layout_that_cannot_fit_is_refused_before_any_work(tmp_path, monkeypatch):
    import primus.core.kernels.selection
    from primus.core.contracts.errors import UserError
    from primus.core.launch.rank import run_rank
    from primus.core.launch.resolve import resolve
    from primus.core.planner import auto

    out = tmp_path / "run"
    res = resolve(
        "llama3.1-70b",
        ["backend.name=megatron", "train.seq_len=4096", "train.micro_batch_size=1", f"logging.output_dir={out}"],
        world_size=1,
        check_plugins=False,  # core's tests run without the backends installed too
    )
    monkeypatch.setattr(primus.core.kernels.selection, "detect_device", lambda: "cuda")
    monkeypatch.setattr(auto, "local_device", lambda: device("H100"))
    with pytest.raises(UserError, match=r"llama3.1-70b does not fit: an estimated \d+\.\d GiB per device \(weights"):
        run_rank(res)
    assert not out.exists()  # nothing was built or written
    # a layout within the model's error of the device's memory is let through (70B fits in 1.5 TB)
    monkeypatch.setattr(auto, "local_device", lambda: device("H100", 1500))
    auto.check_fits(res.config, 1)


def _untied(registry, name):
    return _model(registry, name).model_copy(update={"tie_word_embeddings": False})


@pytest.mark.parametrize(
    "name,seq,micro,measured_mfu",
    [("llama3.2-1b", 4096, 2, 0.498), ("llama3.2-3b", 4096, 2, 0.557), ("llama3.2-1b", 8192, 1, 0.532)],
)
def test_step_time_reproduces_the_h200_baseline(registry, name, seq, micro, measured_mfu):
    """The calibrated step-time model against TorchTitan eager on one H200 (benchmarks/results/h200_baseline.md). On one device no
    engine fact enters the step time (the profile gives only the gradients' bytes on the wire)."""
    from primus.core.planner.search import evaluate

    c = evaluate(
        _untied(registry, name),
        _on(ENGINE, "ddp", 1, micro_batch=micro),
        seq,
        micro,
        Cluster(device("H200"), 1, 1),
        "bf16",
    )
    assert c.mfu == pytest.approx(measured_mfu, rel=0.05)


def test_fp8_gemms_run_at_the_fp8_rate(registry):
    from primus.core.planner.memory import fp8_layers
    from primus.core.planner.perf import gemm_rate, layer_seconds_per_token, step_time

    m = _model(registry, "llama3.1-8b")
    h200 = device("H200")
    assert gemm_rate(h200, "tensorwise") / gemm_rate(h200) == pytest.approx(1979 / 989 * 0.99)
    assert gemm_rate(device("A100"), "rowwise") == gemm_rate(device("A100"))  # no FP8 tensor cores
    assert gemm_rate(device("MI300X"), "tensorwise") / gemm_rate(device("MI300X")) == pytest.approx(2615 / 1307 * 0.99)
    bf16 = layer_seconds_per_token(m, 8192, h200)
    fp8 = layer_seconds_per_token(m, 8192, h200, "rowwise")
    assert 1.6 < bf16["gemm"] / fp8["gemm"] < 2.0 and fp8["fp8_casts"] > 0 and fp8["attention"] == bf16["attention"]
    lay = _on(ENGINE, "fsdp", dp=8, micro_batch=1, micro_batches=4)
    t_bf16 = step_time(m, lay, 8192, 32, h200, 8).total
    t_fp8 = step_time(m, lay, 8192, 32, h200, 8, KernelTerms("rowwise")).total
    assert t_bf16 / 2 < t_fp8 < t_bf16
    assert fp8_layers(m, "rowwise", 1, 1) == m.num_layers - 2 and fp8_layers(m, "off") == 0
    # only the FP8 layers' GEMMs speed up
    t_some = step_time(m, lay, 8192, 32, h200, 8, KernelTerms("rowwise", fp8_layers(m, "rowwise", 8, 8))).total
    assert t_fp8 < t_some < t_bf16


def test_fp8_memory_trades_weight_copies_and_saved_inputs(registry):
    from primus.core.planner import calibration as cal

    m = _model(registry, "llama3.1-8b")
    per_layer, d, f, s, L = count_params(m).per_layer, m.hidden_size, m.ffn_hidden_size, 8192, m.num_layers
    inputs = s * (3 * d + f)  # per layer: the FP8 linears' input elements of one micro-batch
    # FSDP gathers bf16 weights (no autocast copy): tensorwise adds its e4m3 copy, keeps its inputs in e4m3
    fsdp = _on(ENGINE, "fsdp", dp=8, micro_batch=1, micro_batches=4)
    mem = estimate(m, fsdp, s, "bf16", KernelTerms("tensorwise")).parts
    assert mem["fp8"] == pytest.approx(L * (1 * per_layer - 1 * inputs))
    assert "fp8" not in estimate(m, fsdp, s).parts
    half = estimate(m, fsdp, s, "bf16", KernelTerms("tensorwise", L // 2)).parts["fp8"]
    assert half == pytest.approx(mem["fp8"] / 2)
    # one device: autocast's 2-byte copies are what FP8 layers no longer make; rowwise keeps its inputs' transposed
    # e4m3 copies (1 byte fewer an element)
    one = _on(ENGINE, "ddp", dp=1, micro_batch=2)
    row = estimate(m, one, s, "bf16", KernelTerms("rowwise")).parts["fp8"]
    copies = -cal.AUTOCAST_WEIGHT_COPY_BYTES * L * per_layer
    assert row == pytest.approx(copies - 1 * L * 2 * inputs)
    # compiled, the partitioner keeps 2 bytes fewer per input element in either recipe (measured on the H200)
    comp = estimate(m, one, s, "bf16", KernelTerms("rowwise", compiled=True)).parts["fp8"]
    assert comp == pytest.approx(copies - 2 * L * 2 * inputs)
    # FP8 is below bf16 where autocast made copies, and its recomputed layers save no inputs
    assert estimate(m, one, s, "bf16", KernelTerms("tensorwise")).total < estimate(m, one, s).total
    full = _on(ENGINE, "ddp", dp=1, micro_batch=2, recompute="full")
    assert estimate(m, full, s, "bf16", KernelTerms("tensorwise")).parts["fp8"] == pytest.approx(-L * per_layer)


def test_plan_shows_fp8():
    args = ["plan", "--preset", "llama3.1-8b", "--device", "H200", "--engine", "torchtitan", "train.seq_len=8192"]
    off = CliRunner().invoke(cli.app, args)
    on = CliRunner().invoke(cli.app, [*args, "kernels.fp8=rowwise", "kernels.fp8_recipe.bf16_last_layers=2"])
    assert off.exit_code == 0 and on.exit_code == 0, on.output
    assert "FP8" not in off.output and "fp8" not in off.output
    assert "FP8 rowwise GEMMs in 30 of 32 layers" in " ".join(on.output.split()) and "recommended:" in on.output
    assert on.output.rstrip().endswith("FP8 rowwise")


def test_memory_splits_what_the_allocator_sees(registry):
    from primus.core.planner import calibration as cal

    m = _model(registry, "llama3.2-1b")
    one = estimate(m, _on(GENERIC, "ddp", dp=1), 4096)
    eight = estimate(m, _on(GENERIC, "ddp", dp=8), 4096)
    assert one.parts["context"] == cal.CONTEXT_BYTES  # no NCCL buffers without another rank
    assert eight.parts["context"] == cal.CONTEXT_BYTES + cal.COMM_BUFFER_BYTES
    assert one.allocator == pytest.approx(one.total - cal.CONTEXT_BYTES)
    assert one.allocated == pytest.approx(one.allocator - one.parts["fragmentation"])
    # an engine under autocast without FSDP keeps an fp32 residual stream: more activation memory per layer
    autocast = estimate(m, _on(ENGINE, "ddp", dp=1), 4096).parts["activations"]
    fsdp = estimate(m, _on(ENGINE, "fsdp", dp=8), 4096).parts["activations"]
    d = m.hidden_size
    assert autocast - fsdp == pytest.approx(m.num_layers * 4096 * 2 * d * (4 - 2))


def test_fused_loss_memory_only_where_the_engine_fuses(registry):
    """The fused linear + cross-entropy holds one chunk of logits, where the engine's profile says it fuses: the
    generic engine without TP, PP or CP, one that refuses nothing under PP too (never under TP: core's rule), one that
    computes its own loss nowhere; elsewhere the full logits are counted."""
    m = _model(registry, "llama3.2-1b")
    anywhere = EngineProfile(name="anywhere", fused_loss_refused={})
    own = EngineProfile(name="own", fused_loss=False)

    def logits(profile, fused, **dims):
        return estimate(m, _on(profile, "fsdp", dp=1, **dims), 4096, kernels=KernelTerms(fused_loss=fused)).parts[
            "logits"
        ]

    full = logits(GENERIC, False)
    assert logits(GENERIC, True) < full / 4
    for dims in ({"tp": 2}, {"pp": 2}, {"cp": 2}):
        assert logits(GENERIC, True, **dims) == logits(GENERIC, False, **dims), dims
    assert logits(anywhere, True) < full / 4 and logits(anywhere, True, pp=2) < full / 4
    assert logits(anywhere, True, tp=2) == logits(anywhere, False, tp=2)
    assert logits(own, True) == full
    # an FP8 output head is not fused (the backend's own rule, fused_loss_refusal): all logits are held
    fp8_head = estimate(m, _on(GENERIC, "fsdp", dp=1), 4096, kernels=KernelTerms(fused_loss=True, fp8_head=True))
    assert fp8_head.parts["logits"] == logits(GENERIC, False)
    from primus.core.config.schema import PrimusConfig
    from primus.core.planner.strategies import kernel_terms

    cfg = PrimusConfig.model_validate({"kernels": {"fp8": "tensorwise", "fp8_recipe": {"bf16_output_head": False}}})
    assert kernel_terms(cfg).fp8_head and not kernel_terms(PrimusConfig()).fp8_head


# --- mixture of experts ---------------------------------------------------------------------------------------------


def test_experts_split_by_expert_parallelism_and_sharded_over_all_data_parallel_ranks(registry):
    """A device holds E / ep routed experts whole; FSDP and the distributed optimizer divide the experts over the
    expert-data-parallel group (dp / ep ranks), so a sharded expert byte is 1 / dp per device whatever ep is."""
    from primus.core.planner.memory import routed_expert_params

    m = _model(registry, "qwen3-30b-a3b")
    pc, per_layer = count_params(m), routed_expert_params(m)
    experts = pc.moe_layers * per_layer
    rest = pc.total - experts
    assert per_layer == 128 * 3 * 2048 * 768 and experts / pc.total > 0.9  # the experts are most of the model
    for ep in (1, 2, 8):
        ddp = estimate(m, _on(GENERIC, "ddp", dp=8, ep=ep), 4096).parts
        assert ddp["weights"] == pytest.approx(2 * (rest + experts / ep))
        fsdp = estimate(m, _on(GENERIC, "fsdp", dp=8, ep=ep), 4096).parts
        assert fsdp["weights"] == pytest.approx(2 * pc.total / 8)
        dist = estimate(m, _on(GENERIC, "ddp_distopt", dp=8, ep=ep), 4096).parts
        assert dist["optimizer"] == pytest.approx(12 * pc.total / 8) and dist["gradients"] == ddp["gradients"]


def test_moe_activations_are_the_experts_a_token_runs(registry):
    """Per token an MoE layer keeps k experts' SwiGLU activations and its permuted copies, not the E experts'."""
    m = _model(registry, "qwen3-30b-a3b")
    dense = m.model_copy(update={"moe": None})
    e, d = m.moe, m.hidden_size
    got = estimate(m, _on(GENERIC, "ddp", dp=8, ep=8), 4096).parts["activations"]
    want = estimate(dense, _on(GENERIC, "ddp", dp=8), 4096).parts["activations"]
    # the dense twin's MLP keeps 3f per token; the MoE layer 3k·e + 2k·d + 2E instead, 2 bytes each, every layer
    delta = 4096 * 2 * (3 * e.experts_per_token * e.expert_ffn_hidden_size + 2 * e.experts_per_token * d)
    delta += 4096 * 2 * (2 * e.num_experts - 3 * m.ffn_hidden_size)
    assert got - want == pytest.approx(delta * m.num_layers * GENERIC.activation_scale)


def test_moe_step_time_counts_active_weights_and_all_to_alls(registry):
    from primus.core.planner import calibration as cal
    from primus.core.planner.perf import (
        active_layer_params,
        expert_all_to_all,
        gemm_rate,
        layer_seconds_per_token,
        moe_gemm_fraction,
        tokens_per_expert,
    )

    m = _model(registry, "qwen3-30b-a3b")
    dev = device("H100")
    pc, e = count_params(m), m.moe
    dense, routed = active_layer_params(m)
    assert (dense + routed) * m.num_layers == pytest.approx(pc.active - pc.embedding - pc.output_head - pc.final_norm)
    assert routed == e.experts_per_token * 3 * m.hidden_size * e.expert_ffn_hidden_size  # every layer is MoE
    # the routed experts' grouped GEMMs: the dense rate from 1,024 rows per expert, slower with fewer (H200: 0.65 of it
    # at the 256 rows of one 4096-token sequence over 128 experts, top 8)
    assert moe_gemm_fraction(cal.MOE_GEMM_FULL_RATE_TOKENS) == moe_gemm_fraction(8192) == 1.0
    assert moe_gemm_fraction(256) == pytest.approx(0.65, abs=0.01) and moe_gemm_fraction(64) < moe_gemm_fraction(256)
    assert tokens_per_expert(m, _on(GENERIC, "fsdp", dp=8), 4096) == 4096 * 8 / 128
    assert tokens_per_expert(m, _on(GENERIC, "fsdp", dp=8, ep=8, tp=2), 4096) == 4096 / 2 * 8 * 8 / 128
    terms = layer_seconds_per_token(m, 4096, dev, expert_tokens=256, dispatch_passes=60)
    rate = gemm_rate(dev)
    assert terms["gemm"] == pytest.approx(6 * dense / rate + 6 * routed / (rate * moe_gemm_fraction(256)))
    # each token's k copies routed there and back: the engine's passes over k · d bf16 elements
    assert terms["routing"] == pytest.approx(60 * 2 * 8 * m.hidden_size / (dev.step_hbm_gbps * 1e9))
    assert "routing" not in layer_seconds_per_token(_model(registry, "llama3.1-8b"), 4096, dev)
    assert expert_all_to_all(m, _on(GENERIC, "fsdp", dp=8), 4096, dev, 8) == 0.0
    # 4 all-to-alls per MoE layer of k·d bf16 elements per token, 7/8 of them off the device; EP over two nodes is slower
    one_node = expert_all_to_all(m, _on(GENERIC, "fsdp", dp=8, ep=8), 4096, dev, 8)
    assert one_node == pytest.approx(4 * m.num_layers * 4096 * 8 * 2048 * 2 * 7 / 8 / (dev.intra_gbps * 1e9))
    assert expert_all_to_all(m, _on(GENERIC, "fsdp", dp=16, ep=16), 4096, dev, 8) > 2 * one_node


def test_planner_plans_moe_layouts_with_expert_parallelism(registry):
    """Qwen3-30B-A3B on two 8-GPU H100 nodes: expert-parallel layouts are searched (EP sizes that divide the experts
    and the data-parallel ranks), MFU counts the active parameters, and a layout is recommended."""
    from primus.core.planner import best, candidates
    from primus.core.planner.modelmath import flops_per_token

    m = _model(registry, "qwen3-30b-a3b")
    cluster = Cluster(device("H100"), 2, 8)
    cands = candidates(m, cluster, 4096, micro_batch=1, global_batch=64)
    eps = {c.layout.ep for c in cands}
    assert eps == {1, 2, 4, 8, 16}
    top = best(cands)
    assert top is not None and top.layout.ep > 1, top.layout.describe()
    assert "EP" in top.layout.describe()
    assert top.mfu == pytest.approx(top.tokens_per_s_per_device * flops_per_token(m, 4096) / cluster.device.peak_flops)
    assert flops_per_token(m, 4096) < 6 * 0.15 * count_params(m).total + 12 * m.num_layers * 4096 * 4096  # active


def test_the_optimizer_step_moves_the_engines_bytes_per_parameter(registry):
    """Each engine's measured per-parameter step work (EngineProfile.optimizer_bytes_per_param: megatron without apex
    moved ~139 bytes per parameter on the H200, TorchTitan ~68) enters the step time once per step, over the device's
    parameters."""
    from dataclasses import replace

    from primus.core.planner.memory import stage_params
    from primus.core.planner.perf import step_time

    m, h200 = _model(registry, "llama3.2-1b"), device("H200")
    lean, heavy = ENGINE, replace(ENGINE, optimizer_bytes_per_param=ENGINE.optimizer_bytes_per_param + 100)
    times = [step_time(m, _on(p, "ddp", 1, micro_batch=2), 4096, 2, h200, 1).total for p in (lean, heavy)]
    params, _ = stage_params(m, _on(ENGINE, "ddp", 1))
    assert times[1] - times[0] == pytest.approx(100 * params / (h200.hbm_gbps * 1e9), rel=1e-9)


def test_routed_experts_count_their_whole_per_parameter_work(registry, monkeypatch):
    """A routed expert's parameters each add calibration.EXPERT_STEP_BYTES_PER_PARAM (measured alike on both engines),
    whatever the engine's dense number; the rest of the model the engine's; expert parallelism divides the experts'."""
    from dataclasses import replace

    from primus.core.planner import calibration as cal
    from primus.core.planner.memory import routed_expert_params, stage_params
    from primus.core.planner.perf import step_time

    m, h200 = _model(registry, "qwen3-30b-a3b"), device("H200")
    hbm = h200.hbm_gbps * 1e9
    heavy = replace(ENGINE, optimizer_bytes_per_param=ENGINE.optimizer_bytes_per_param + 100)
    for ep in (1, 2):
        lay = {p: _on(p, "ddp", ep, ep=ep, micro_batch=1) for p in (ENGINE, heavy)}
        t = {p: step_time(m, lay[p], 4096, ep, h200, 8) for p in lay}
        params, _ = stage_params(m, lay[ENGINE])
        experts = m.num_layers * routed_expert_params(m) / ep
        assert t[heavy].compute - t[ENGINE].compute == pytest.approx(100 * (params - experts) / hbm, rel=1e-9)
        before = t[ENGINE].compute
        monkeypatch.setattr(cal, "EXPERT_STEP_BYTES_PER_PARAM", cal.EXPERT_STEP_BYTES_PER_PARAM + 100)
        after = step_time(m, lay[ENGINE], 4096, ep, h200, 8).compute
        monkeypatch.undo()
        assert after - before == pytest.approx(100 * experts / hbm, rel=1e-9)


def test_sharded_experts_step_their_share_whatever_the_expert_parallelism(registry, monkeypatch):
    """Under FSDP or the distributed optimizer a device steps its E / ep experts' share over their own data-parallel
    group (dp / ep ranks): 1 / dp of all the experts' parameters, the same at every ep (not divided by ep once more)."""
    from primus.core.planner import calibration as cal
    from primus.core.planner.memory import routed_expert_params
    from primus.core.planner.perf import step_time

    m, h200 = _model(registry, "qwen3-30b-a3b"), device("H200")
    share = m.num_layers * routed_expert_params(m) / 8
    for mode in ("fsdp", "ddp_distopt"):
        for ep in (1, 2, 8):
            lay = _on(ENGINE, mode, 8, ep=ep, micro_batch=1)
            before = step_time(m, lay, 4096, 8, h200, 8).compute
            monkeypatch.setattr(cal, "EXPERT_STEP_BYTES_PER_PARAM", cal.EXPERT_STEP_BYTES_PER_PARAM + 100)
            after = step_time(m, lay, 4096, 8, h200, 8).compute
            monkeypatch.undo()
            assert after - before == pytest.approx(100 * share / (h200.hbm_gbps * 1e9), rel=1e-9), (mode, ep)


def test_context_parallelism_is_searched_for_long_sequences_with_its_ring_counted(registry):
    """CP layouts are tried from calibration.CP_MIN_SEQ_LEN tokens, each rank keeping CP_MIN_TOKENS_PER_RANK; the
    ring's K/V exchange hides behind a long sequence's attention (only the per-step cost stays) and shows where the
    attention is short; at 128k on one H200 node a CP layout is the fastest that fits."""
    from primus.core.planner import calibration as cal
    from primus.core.planner import candidates
    from primus.core.planner.perf import context_parallel_exchange
    from primus.core.planner.search import _cp_options

    assert _cp_options(8192, 8) == [1]
    assert _cp_options(131072, 8) == [1, 2, 4, 8]
    assert _cp_options(32768, 16) == [1, 2, 4, 8]  # cp 16 would leave 2,048 tokens a rank
    m, h200 = _model(registry, "llama3.1-8b"), device("H200")
    lay = _on(GENERIC, "ddp", 1, cp=8, micro_batches=2)
    assert context_parallel_exchange(m, _on(GENERIC, "ddp", 8, micro_batches=2), 131072, h200, 8) == 0.0
    fixed = m.num_layers * 2 * 3 * 7 * cal.CP_RING_STEP_S  # layers x micro-batches x passes x ring steps
    assert context_parallel_exchange(m, lay, 131072, h200, 8) == pytest.approx(fixed)  # hidden by the attention
    assert context_parallel_exchange(m, lay, 1024, h200, 8) > fixed  # 1k tokens: the attention hides little
    on_two_nodes = context_parallel_exchange(m, lay, 4096, h200, 4)  # the ring crosses nodes
    assert on_two_nodes > context_parallel_exchange(m, lay, 4096, h200, 8)
    cands = candidates(m, Cluster(h200, 1, 8, cal.HEADROOM), 131072, 1, 16)
    assert next(c for c in cands if c.fits).layout.cp > 1
    assert all(c.layout.cp == 1 for c in candidates(m, Cluster(h200, 1, 8), 8192, 1, 64))


def test_fused_norm_and_swiglu_kernels_leave_the_engines_share_of_the_memory_bound_work(registry):
    """A provider's fused norm and SwiGLU (KernelTerms.fused_elementwise) leave the engine's ``fused_kernels_kept`` of
    the per-token memory-bound passes, and nothing else; core's own (torch) kernels are not fused."""
    from dataclasses import replace

    from primus.core.launch.resolve import resolve
    from primus.core.planner.perf import layer_seconds_per_token, step_time
    from primus.core.planner.strategies import kernel_terms

    m, h100 = _model(registry, "llama3.2-1b"), device("H100")
    eager = layer_seconds_per_token(m, 4096, h100)
    fused = layer_seconds_per_token(m, 4096, h100, kernels_kept=0.25)
    assert fused["memory_bound"] == pytest.approx(0.25 * eager["memory_bound"])
    assert {k: v for k, v in fused.items() if k != "memory_bound"} == {
        k: v for k, v in eager.items() if k != "memory_bound"
    }
    engine = replace(ENGINE, fused_kernels_kept=0.25)
    lay = _on(engine, "ddp", 1, micro_batch=2)
    plain = step_time(m, lay, 4096, 2, h100, 1).total
    turbo = step_time(m, lay, 4096, 2, h100, 1, KernelTerms(fused_elementwise=True)).total
    saved = 2 * 4096 * m.num_layers * 0.75 * eager["memory_bound"]
    assert plain - turbo == pytest.approx(saved, rel=1e-9)
    cfg = resolve("tiny-llama", ["backend.name=fake"], world_size=1, registry=registry).config
    torch_only = cfg.model_copy(update={"kernels": cfg.kernels.model_copy(update={"rms_norm": "torch"})})
    assert not kernel_terms(torch_only, registry).fused_elementwise


def test_the_step_memory_rate_is_the_calibrated_one_where_measured():
    """Memory-bound work runs at calibration.STEP_HBM_GBPS where it was fitted (the H100: near the H200's, not its
    datasheet's ratio), at the datasheet's bandwidth elsewhere."""
    from primus.core.planner import calibration as cal

    assert device("H100").step_hbm_gbps == cal.STEP_HBM_GBPS["H100"] > device("H100").hbm_gbps
    assert device("H200").step_hbm_gbps == device("H200").hbm_gbps
    assert device("A100").step_hbm_gbps == device("A100").hbm_gbps


def test_multi_token_prediction_adds_a_block_and_the_head_per_token(registry):
    """Each MTP depth runs one more block, its eh_proj (2d -> d) and the output head again, on the last stage."""
    from primus.core.config.schema import MTPConfig
    from primus.core.planner import calibration as cal
    from primus.core.planner.memory import stage_params
    from primus.core.planner.perf import gemm_rate, layer_seconds_per_token, step_time

    m, h100 = _model(registry, "llama3.2-1b"), device("H100")
    mtp = m.model_copy(update={"mtp": MTPConfig(layers=2)})
    lay = _on(ENGINE, "ddp", 1, micro_batch=1)
    added = step_time(mtp, lay, 4096, 1, h100, 1).compute - step_time(m, lay, 4096, 1, h100, 1).compute
    d, hbm = m.hidden_size, h100.step_hbm_gbps * 1e9
    block = sum(layer_seconds_per_token(m, 4096, h100).values())
    head = 6 * m.vocab_size * d / gemm_rate(h100) + cal.LOSS_BYTES_PER_LOGIT * m.vocab_size / hbm
    per_token = 2 * (block + 6 * 2 * d * d / gemm_rate(h100) + head)
    optimizer = ENGINE.optimizer_bytes_per_param * (stage_params(mtp, lay)[0] - stage_params(m, lay)[0]) / hbm
    assert added == pytest.approx(4096 * per_token + optimizer, rel=1e-9)
