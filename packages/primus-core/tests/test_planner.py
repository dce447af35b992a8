"""The planner: its memory formulas, and the seed's recommendations coming out of the model."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from primus.core import cli
from primus.core.config.loader import load_layers
from primus.core.config.schema import ModelConfig
from primus.core.modelmath import count_params
from primus.core.planner import Cluster, KernelTerms, Layout, best, candidates, device, estimate
from primus.core.presets import resolver
from primus.core.strategies import fused_loss


def _model(registry, name):
    return ModelConfig.model_validate(load_layers(name, resolve_preset=resolver(registry)).data["model"])


def test_state_bytes_per_parameter(registry):
    m = _model(registry, "qwen2.5-7b")
    p = count_params(m).total
    ddp = estimate(m, Layout("megatron", "ddp", dp=8), 4096).parts
    dist = estimate(m, Layout("megatron", "ddp_distopt", dp=8), 4096).parts
    fsdp_tt = estimate(m, Layout("torchtitan", "fsdp", dp=8), 4096).parts
    ddp_tt = estimate(m, Layout("torchtitan", "ddp", dp=8), 4096).parts
    assert (ddp["weights"], ddp["gradients"], ddp["optimizer"]) == (2 * p, 4 * p, 12 * p)
    assert dist["optimizer"] == pytest.approx(12 * p / 8) and dist["gradients"] == 4 * p
    assert (fsdp_tt["weights"], fsdp_tt["optimizer"]) == (pytest.approx(4 * p / 8), pytest.approx(8 * p / 8))
    assert ddp_tt["optimizer"] == 8 * p  # TorchTitan's DDP has no distributed optimizer


def test_activation_memory_orders(registry):
    m = _model(registry, "llama3.1-8b")
    act = {
        rc: estimate(m, Layout("megatron", "ddp", dp=1, recompute=rc), 8192).parts["activations"]
        for rc in ("none", "selective", "full")
    }
    assert act["full"] < act["selective"] <= act["none"]  # megatron's selective drops only flash attention's (nothing)
    tt = {
        rc: estimate(m, Layout("torchtitan", "fsdp", dp=8, recompute=rc), 8192).parts["activations"]
        for rc in ("none", "selective", "full")
    }
    assert tt["full"] < tt["selective"] < tt["none"]
    # Llama 8B at seq 8192, bf16, one sample: 2·s·(6d + 2·kv·c + 3f) bytes per layer
    assert act["none"] == pytest.approx(32 * 2 * 8192 * (6 * 4096 + 2 * 8 * 128 + 3 * 14336))
    tp = estimate(m, Layout("megatron", "ddp", dp=1, tp=4), 8192).parts["activations"]
    assert tp == pytest.approx(act["none"] / 4)  # sequence parallel shards all of it
    pp = estimate(m, Layout("megatron", "ddp", dp=1, pp=4, micro_batches=8), 8192).parts["activations"]
    assert pp == pytest.approx(act["none"] / 4 * 4)  # a quarter of the layers, 4 micro-batches in flight
    vpp = estimate(m, Layout("megatron", "ddp", dp=1, pp=4, vpp=2, micro_batches=8), 8192).parts["activations"]
    assert vpp == pytest.approx(pp * (1 + 3 / 8))  # Megatron's interleaving penalty


def _plan(registry, name, dev, nodes, seq, engine):
    return best(candidates(_model(registry, name), Cluster(device(dev), nodes, 8), seq, engine=engine))


def test_qwen7b_on_8_gpus_is_data_parallel_with_distributed_optimizer(registry):
    c = _plan(registry, "qwen2.5-7b", "MI300X", 1, 4096, "megatron")
    assert (c.layout.dp_mode, c.layout.dp, c.layout.tp, c.layout.pp) == ("ddp_distopt", 8, 1, 1)
    assert c.layout.recompute == "none"


def test_llama70b_one_node_is_fsdp_with_full_recompute(registry):
    c = _plan(registry, "llama3.1-70b", "MI300X", 1, 8192, "torchtitan")
    assert (c.layout.dp_mode, c.layout.dp, c.layout.tp, c.layout.recompute) == ("fsdp", 8, 1, "full")


def test_llama70b_on_8_nodes_recomputes_less(registry):
    c = _plan(registry, "llama3.1-70b", "MI300X", 8, 8192, "torchtitan")
    assert c.layout.dp_mode == "fsdp" and c.layout.recompute in ("none", "selective", "partial")


def test_llama405b_is_tp_pp_vpp(registry):
    c = _plan(registry, "llama3.1-405b", "MI300X", 64, 8192, "megatron")
    assert c.layout.tp > 1 and c.layout.pp > 1 and c.layout.vpp > 1 and c.layout.dp_mode == "ddp_distopt"


def test_torchtitan_8b_is_fsdp(registry):
    c = _plan(registry, "llama3.1-8b", "H100", 1, 8192, "torchtitan")
    assert c.layout.dp_mode == "fsdp" and c.layout.dp == 8


def test_nothing_fits_is_refused_with_numbers():
    res = CliRunner().invoke(cli.app, ["plan", "--preset", "llama3.1-405b", "--device", "H100", "train.seq_len=8192"])
    assert res.exit_code == 3
    assert "nothing fits" in res.output and "GiB per GPU" in res.output and "72.0 GiB usable" in res.output


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
    from primus.core.planner import auto
    from primus.core.train import resolve

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
    from primus.core.planner import auto
    from primus.core.train import resolve

    monkeypatch.setattr(auto, "local_device", lambda: device("H100"))
    with pytest.raises(ConfigError, match="parallel.strategy: auto: no layout fits 8 × H100"):
        resolve(
            "llama3.1-405b",
            ["backend.name=fake", "parallel.strategy=auto", "train.seq_len=8192"],
            world_size=8,
            registry=registry,
        )


def test_named_strategy_fills_and_keeps_explicit_sizes(registry):
    from primus.core.train import resolve

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
    from primus.core.protocols import load_ref
    from primus.core.train import resolve

    res = resolve(
        "llama3.1-8b",
        ["backend.name=fake", "parallel.strategy=ddp", "train.seq_len=4096", "train.micro_batch_size=1"],
        world_size=8,
        registry=registry,
    )
    est = load_ref(registry.strategies["ddp"].estimate)(res.config, 8)
    want = estimate(
        res.config.model,
        Layout("megatron", "ddp_distopt", dp=8),
        4096,
        kernels=KernelTerms(fused_loss=fused_loss(res.config)),
    )
    assert est.parts == want.parts and est.total == pytest.approx(want.total)


def test_auto_refusal_gives_the_numbers(registry, monkeypatch):
    from primus.core.config.errors import ConfigError
    from primus.core.planner import auto
    from primus.core.train import resolve

    monkeypatch.setattr(auto, "local_device", lambda: device("H100"))
    with pytest.raises(ConfigError, match=r"72\.0 usable.*the smallest \(.*\) needs \d+\.\d GiB per device"):
        resolve(
            "llama3.1-405b",
            ["backend.name=fake", "parallel.strategy=auto", "train.seq_len=8192"],
            world_size=8,
            registry=registry,
        )


def test_a_layout_that_cannot_fit_is_refused_before_any_work(tmp_path, monkeypatch):
    import primus.core.kernels
    from primus.core.errors import UserError
    from primus.core.planner import auto
    from primus.core.train import resolve, run_rank

    out = tmp_path / "run"
    res = resolve(
        "llama3.1-70b",
        ["backend.name=megatron", "train.seq_len=4096", "train.micro_batch_size=1", f"logging.output_dir={out}"],
        world_size=1,
        check_plugins=False,  # core's tests run without the backends installed too
    )
    monkeypatch.setattr(primus.core.kernels, "detect_device", lambda: "cuda")
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
    """The calibrated step-time model against TorchTitan eager on one H200 (h200-baseline.md)."""
    from primus.core.planner.search import evaluate

    c = evaluate(
        _untied(registry, name),
        Layout("torchtitan", "ddp", 1, micro_batch=micro),
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
    lay = Layout("torchtitan", "fsdp", dp=8, micro_batch=1, micro_batches=4)
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
    fsdp = Layout("torchtitan", "fsdp", dp=8, micro_batch=1, micro_batches=4)
    mem = estimate(m, fsdp, s, "bf16", KernelTerms("tensorwise")).parts
    assert mem["fp8"] == pytest.approx(L * (1 * per_layer - 1 * inputs))
    assert "fp8" not in estimate(m, fsdp, s).parts
    half = estimate(m, fsdp, s, "bf16", KernelTerms("tensorwise", L // 2)).parts["fp8"]
    assert half == pytest.approx(mem["fp8"] / 2)
    # one device: autocast's 2-byte copies are what FP8 layers no longer make; rowwise keeps its inputs in bf16
    one = Layout("torchtitan", "ddp", dp=1, micro_batch=2)
    row = estimate(m, one, s, "bf16", KernelTerms("rowwise")).parts["fp8"]
    assert row == pytest.approx(-cal.AUTOCAST_WEIGHT_COPY_BYTES * L * per_layer)
    # compiled, the partitioner keeps 2 bytes fewer per input element in either recipe (measured on the H200)
    comp = estimate(m, one, s, "bf16", KernelTerms("rowwise", compiled=True)).parts["fp8"]
    assert comp == pytest.approx(row - 2 * L * 2 * inputs)
    # FP8 is below bf16 where autocast made copies, and its recomputed layers save no inputs
    assert estimate(m, one, s, "bf16", KernelTerms("tensorwise")).total < estimate(m, one, s).total
    full = Layout("torchtitan", "ddp", dp=1, micro_batch=2, recompute="full")
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
    one = estimate(m, Layout("megatron", "ddp", dp=1), 4096)
    eight = estimate(m, Layout("megatron", "ddp", dp=8), 4096)
    assert one.parts["context"] == cal.CONTEXT_BYTES  # no NCCL buffers without another rank
    assert eight.parts["context"] == cal.CONTEXT_BYTES + cal.COMM_BUFFER_BYTES
    assert one.allocator == pytest.approx(one.total - cal.CONTEXT_BYTES)
    assert one.allocated == pytest.approx(one.allocator - one.parts["fragmentation"])
    # TorchTitan without FSDP keeps an fp32 residual stream under autocast: more activation memory per layer
    tt = estimate(m, Layout("torchtitan", "ddp", dp=1), 4096).parts["activations"]
    fsdp = estimate(m, Layout("torchtitan", "fsdp", dp=8), 4096).parts["activations"]
    d = m.hidden_size
    assert tt - fsdp == pytest.approx(m.num_layers * 4096 * 2 * d * (4 - 2))


def test_fused_loss_memory_only_where_the_engine_fuses(registry):
    """The fused linear + cross-entropy holds one chunk of logits; megatron uses it at tp 1 (also under PP, on the
    last stage), torchtitan only without TP, PP or CP: elsewhere the full logits are counted."""
    m = _model(registry, "llama3.2-1b")

    def logits(engine, fused, **dims):
        return estimate(m, Layout(engine, "fsdp", dp=1, **dims), 4096, kernels=KernelTerms(fused_loss=fused)).parts[
            "logits"
        ]

    full = logits("megatron", False)
    assert logits("megatron", True) < full / 4 and logits("megatron", True, pp=2) < full / 4
    assert logits("torchtitan", True) < full / 4
    assert logits("torchtitan", True, pp=2) == logits("torchtitan", False, pp=2)
    assert logits("torchtitan", True, tp=2) == logits("torchtitan", False, tp=2)
    # an FP8 output head is not fused (the backend's own rule, fused_loss_refusal): all logits are held
    fp8_head = estimate(
        m, Layout("torchtitan", "fsdp", dp=1), 4096, kernels=KernelTerms(fused_loss=True, fp8_head=True)
    )
    assert fp8_head.parts["logits"] == logits("torchtitan", False)
    from primus.core.config.schema import PrimusConfig
    from primus.core.strategies import kernel_terms

    cfg = PrimusConfig.model_validate({"kernels": {"fp8": "tensorwise", "fp8_recipe": {"bf16_output_head": False}}})
    assert kernel_terms(cfg).fp8_head and not kernel_terms(PrimusConfig()).fp8_head
