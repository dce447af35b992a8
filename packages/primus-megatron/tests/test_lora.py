"""LoRA on the megatron backend (``train.lora``, :mod:`primus.megatron.lora`), fp32 on CPU with gloo.

One 1-rank run (with a probe plugin that snapshots the model at build and at the end) trains 4 steps from core's
canonical base and core's initial adapters, checkpointing at steps 2 and 4: the loss goes down, every base weight is
bit-identical afterwards and only the adapters train. DP 2 (the distributed optimizer, both overlaps), TP 2 and TP 2
with sequence parallelism train its curve; a resume from its step-2 checkpoint equals it; its checkpoints hold the
adapters and their optimizer state, not the base; ``export_adapters`` gives back the adapters it trained, also from
the TP-2 run's checkpoint. The layout mapping (q/k/v interleaved per query group, [gate; up]) is checked on logits:
the LoRA model with random non-zero B equals the model filled with the merged HF weights W + s·B·A.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_helpers import LOSS_TOL, ONE_RANK_SCRIPT, TINY, losses, read_metrics, train

from primus.core.launch.resolve import resolve

LORA = ("train.lora.rank=4", "train.steps=4")
CKPT = ("checkpoint.enabled=true", "checkpoint.interval=2")

# primus train in this process, with a plugin that snapshots the model when it is built and when the run ends
_PROBE = """
import json, sys, torch
from primus.core import hookimpl
from primus.core.contracts.plugins import Registry, build_plugin_manager
from primus.core.launch.resolve import resolve
from primus.core.launch.rank import run_rank
from primus.megatron.lora import hf_adapters

config, out, *overrides = sys.argv[1:]
seen = {}

class Probe:
    @hookimpl
    def primus_on_model_ready(self, config, model_parts, info):
        self.cfg, self.parts = config, model_parts
        self.before = {n: p.detach().clone() for c in model_parts for n, p in c.named_parameters()}

    @hookimpl
    def primus_on_train_end(self, summary, info):
        params = {n: p.detach() for c in self.parts for n, p in c.named_parameters()}
        adapters = {n for n in params if ".lora." in n}
        seen.update(
            adapters=len(adapters),
            trainable=sorted(n for c in self.parts for n, p in c.named_parameters() if p.requires_grad),
            adapter_names=sorted(adapters),
            base_changed=[n for n, p in params.items() if n not in adapters and not torch.equal(self.before[n], p)],
            adapters_unchanged=[n for n in adapters if torch.equal(self.before[n], params[n])],
        )
        torch.save(hf_adapters(self.parts, self.cfg), f"{out}/adapters.pt")

reg = Registry(build_plugin_manager(extra_plugins=[("lora_probe", Probe())]))
run_rank(resolve(config, [f"logging.output_dir={out}", *overrides], world_size=1, registry=reg))
json.dump(seen, open(f"{out}/probe.json", "w"))
"""

# export_adapters of each checkpoint given, in one process
_EXPORT = """
import sys, torch
from pathlib import Path
from primus.core.hf.contract import OFFLINE_OVERRIDES
from primus.core.launch.resolve import resolve
from primus.megatron.hf import INTEROP

out, *checkpoints = sys.argv[1:]
exported = []
for ckpt in checkpoints:  # as primus checkpoint export reads a run's checkpoint: one process
    cfg = resolve(str(Path(ckpt).parent.parent / "config.yaml"), list(OFFLINE_OVERRIDES), world_size=1).config
    exported.append(INTEROP.export_adapters(cfg, Path(ckpt)))
# the first as a PEFT folder, that train.lora.init_from starts the adapters from
from primus.core.hf.peft import write_adapter
from primus.megatron.hf import _Engine
from primus.megatron.lora import attach, hf_adapters

folder = write_adapter(Path(out).parent / "peft", exported[0], cfg)
overrides = [*OFFLINE_OVERRIDES, f"train.lora.init_from={folder}"]
engine = _Engine(resolve(str(Path(checkpoints[0]).parent.parent / "config.yaml"), overrides, world_size=1).config, True)
attach(engine.chunks, engine.cfg)
exported.append(hf_adapters(engine.chunks, engine.cfg))
engine.close()
torch.save(exported, out)
"""

# the LoRA model's logits against the model holding the merged weights, for two target lists
_MAPPING = (
    ONE_RANK_SCRIPT
    + """
import json
from primus.core.kernels.selection import detect_device, select_kernels
from primus.core.launch.resolve import resolve
from primus.core.hf import lora as core
from primus.megatron.hf import fill_from_hf, gather_to_hf, init_canonical
from primus.megatron.lora import attach, hf_adapters, modules
from primus.megatron.model import build_chunks, transformer_config

config, out = sys.argv[1:3]
ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
report = {}
for name, targets in {"all": None, "partial": "[q_proj,v_proj,up_proj,down_proj]"}.items():
    overrides = ["train.lora.rank=4", "train.lora.alpha=8"] + ([f"train.lora.target_modules={targets}"] if targets else [])
    cfg = resolve(config, overrides, world_size=1).config
    kernels = select_kernels(type(cfg.kernels)(), reg, detect_device(), head_dim=cfg.model.kv_channels, dtype="fp32")
    chunks = build_chunks(cfg, transformer_config(cfg), kernels)
    chunk = chunks[0].eval()
    forward = lambda: chunk(ids, torch.arange(ids.shape[1]).expand_as(ids), None).detach().clone()
    init_canonical(chunks, cfg)
    base = gather_to_hf(chunks, cfg.model)
    with torch.no_grad():
        plain = forward()
        attach(chunks, cfg)
        initial = forward()  # B = 0: the adapters add nothing
        gen = torch.Generator().manual_seed(1)
        for _, _, m in modules(chunks):
            for proj in m.values():
                proj.lora_B.copy_(torch.randn(proj.lora_B.shape, generator=gen) * 0.05)
        adapted = forward()
        tensors = hf_adapters(chunks, cfg)
        merged = dict(base)
        for a in core.adapters(cfg.model, cfg.train.lora):
            w = a.module + ".weight"
            merged[w] = core.merged(base[w], tensors[a.name(core.A)], tensors[a.name(core.B)], cfg.train.lora.scaling)
        fill_from_hf(chunks, merged.__getitem__, cfg.model)
        for _, _, m in modules(chunks):
            for proj in m.values():
                proj.lora_B.zero_()
        report[name] = {
            "initial_equals_plain": torch.equal(initial, plain),
            "adapters_move_logits": (adapted - plain).abs().max().item(),
            "merged_vs_adapted": (forward() - adapted).abs().max().item(),
            "logit_scale": adapted.abs().max().item(),
            "adapted_linears": sorted({p for _, p, _ in modules(chunks)}),
            "trainable": sorted(n for n, p in chunk.named_parameters() if p.requires_grad),
        }
json.dump(report, open(out, "w"))
"""
)


def _child(script: str, *args: str | Path, timeout: int = 300) -> None:
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    one = root / "one"
    _child(_PROBE, TINY, one, *LORA, *CKPT)
    out = {"root": root, "one": read_metrics(one), "probe": json.loads((one / "probe.json").read_text())}
    out["ckpt"] = one / "checkpoints"
    out["dp2"] = train(TINY, root / "dp2", 2, *LORA, "parallel.overlap_grad_reduce=true",
                       "parallel.overlap_param_gather=true")  # fmt: skip
    out["tp2"] = train(TINY, root / "tp2", 2, *LORA, "parallel.tp=2", "checkpoint.enabled=true")
    out["tp2_sp"] = train(TINY, root / "tp2_sp", 2, *LORA, "parallel.tp=2", "parallel.sequence_parallel=true")
    return out


def test_loss_goes_down_the_base_stays_and_the_adapters_train(runs):
    rows, probe = runs["one"], runs["probe"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert losses(rows)[-1] < losses(rows)[0] - 0.05, losses(rows)
    # 4 layers × 7 projections × (A, B), each a parameter of the linear's child module "lora"
    assert probe["adapters"] == 4 * 7 * 2
    assert probe["trainable"] == probe["adapter_names"]  # nothing else asks for a gradient
    assert probe["base_changed"] == []  # bit-identical
    assert probe["adapters_unchanged"] == []


@pytest.mark.parametrize("layout", ["dp2", "tp2", "tp2_sp"])
def test_layouts_train_the_one_rank_curve(runs, layout):
    """Within tests/test_same_run.py's tolerance (fp32: reduction order only)."""
    ref = runs["one"]
    assert losses(runs[layout]) == pytest.approx(losses(ref), rel=2e-5, abs=LOSS_TOL)
    assert [r["grad_norm"] for r in runs[layout]] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)


def test_resume_equals_straight_through(runs, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"] / "step_00000002", ckpt / "step_00000002")
    rows = train(TINY, tmp_path / "resumed", 1, *LORA, f"checkpoint.dir={ckpt}", "checkpoint.enabled=true",
                 resume=True)  # fmt: skip
    assert [r["step"] for r in rows] == [3, 4]
    assert losses(rows) == pytest.approx(losses(runs["one"])[2:], abs=1e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in runs["one"][2:]], rel=1e-6)


def test_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs):
    from torch.distributed.checkpoint import FileSystemReader

    from primus.core.hf.lora import adapters

    folder = runs["ckpt"] / "step_00000004"
    # (megatron-core 0.19 holds its common state, not a tensor of the model, in a key of its own)
    keys = [k for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata if "common_state" not in k]
    assert [k for k in keys if ".lora." not in k] == []  # no base weight, nor its optimizer state
    model = [k for k in keys if not k.startswith("optimizer.")]
    # per adapter (its layers stacked): the weight, and Adam's exp_avg and exp_avg_sq
    assert len(model) == 7 * 2 and len(keys) == 3 * len(model), keys
    cfg = resolve(TINY, list(LORA), world_size=1).config
    trainable = sum((a.out_features + a.in_features) * 4 for a in adapters(cfg.model, cfg.train.lora))
    base = 1_300_096 - trainable  # tiny-llama-4l (the run logs "37376 trainable parameters of 1300096")
    size = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".distcp")
    # the adapters and Adam's two moments in fp32, plus serialisation overhead per (tiny) tensor: a fifth of one fp32
    # copy of the base, where a full fine-tuning checkpoint holds three
    assert 3 * 4 * trainable <= size < 4 * base / 5, (size, trainable)


def test_export_adapters_gives_back_what_was_trained_and_a_run_starts_from_them(runs):
    from primus.core.hf.lora import tensor_names

    out = runs["root"] / "exported.pt"
    tp2_ckpt = runs["root"] / "tp2" / "checkpoints" / "step_00000004"
    _child(_EXPORT, out, runs["ckpt"] / "step_00000004", tp2_ckpt)
    one, tp2, started = torch.load(out)
    trained = torch.load(runs["root"] / "one" / "adapters.pt")
    cfg = resolve(TINY, list(LORA), world_size=1).config
    assert list(one) == tensor_names(cfg.model, cfg.train.lora) == list(trained)
    for name, value in one.items():
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        assert torch.equal(value, trained[name]), name
        assert torch.equal(started[name], value), name  # train.lora.init_from of it as a PEFT folder
        assert torch.allclose(tp2[name], value, rtol=1e-4, atol=1e-5), name  # saved by TP 2 (replicated adapters)
    assert one["model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 128)
    assert one["model.layers.3.mlp.down_proj.lora_B.weight"].shape == (128, 4)


@pytest.fixture(scope="module")
def mapping(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lora_mapping") / "mapping.json"
    _child(_MAPPING, TINY, out)
    return json.loads(out.read_text())


@pytest.mark.parametrize("targets", ["all", "partial"])
def test_adapters_map_onto_megatrons_fused_layout(mapping, targets):
    """Random non-zero B: the LoRA model's logits equal those of the model filled (hf.fill_from_hf) with PEFT's
    merged weights W + s·B·A, which fails if a delta lands on the wrong rows of the fused q/k/v (interleaved per
    query group) or [gate; up]; the partial list leaves k and gate without adapters (zeros in the fused delta)."""
    got = mapping[targets]
    assert got["initial_equals_plain"]  # B starts at zero
    assert got["adapters_move_logits"] > 1e-2 * got["logit_scale"]
    assert got["merged_vs_adapted"] < 1e-5 * max(1.0, got["logit_scale"])
    linears = ["mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv"]
    if targets == "partial":
        linears.remove("self_attention.linear_proj")  # no o_proj
        assert not any("k_proj" in n or "gate_proj" in n for n in got["trainable"])
    assert got["adapted_linears"] == linears


def test_a_bf16_run_checkpoints_and_resumes_its_fp32_adapters(tmp_path):
    """A bf16 run (the frozen base in bf16, the adapters fp32) saves its adapters and their optimizer state on one
    rank (megatron's bf16 optimizer maps only bf16 parameters to a checkpoint: the fp32 optimizer steps the adapters)
    and with DP 2's distributed optimizer, and a resume from step 2 continues the one-rank curve exactly."""
    import shutil

    bf16 = (*LORA, *CKPT, "train.precision=bf16")
    one = train(TINY, tmp_path / "one", 1, *bf16)
    dp2 = train(TINY, tmp_path / "dp2", 2, *bf16)
    assert len(one) == len(dp2) == 4 and losses(one)[-1] < losses(one)[0]
    assert losses(dp2) == pytest.approx(losses(one), rel=1e-2)  # bf16: the layouts round differently
    assert (tmp_path / "dp2" / "checkpoints" / "step_00000004").is_dir()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tmp_path / "one" / "checkpoints" / "step_00000002", ckpt / "step_00000002")
    rows = train(TINY, tmp_path / "resumed", 1, *bf16, f"checkpoint.dir={ckpt}", resume=True)
    assert [r["step"] for r in rows] == [3, 4]
    assert losses(rows) == losses(one)[2:]  # bit for bit
