"""DeepSeek-V3-class models (MLA, sigmoid router with its expert bias, group-limited top-k, the routed scaling
factor, a shared expert, the first layer dense, YaRN) on both engines against transformers' DeepseekV3ForCausalLM:
a random tiny HF model of the tiny-deepseek preset's shape (its routing bias random too, so the bias takes part) is
imported (as ``primus checkpoint import`` does), the engine's forward pass gives HF's logits, the export holds the
same tensors bit for bit; a run starts from the HF folder (``train.init_from``); both engines train the same curve
from core's canonical weights, and EP 2, TP 2 and PP 2 (both; megatron's TP with SP), FSDP 2 (TorchTitan) the
one-rank curve; FP8 on MLA's projections tracks the fp32 curve; multi-token prediction trains on megatron (TP 2 its
one-rank curve) and its weights round-trip; the planner's layouts for DeepSeek-V3 on 32×8 H200 pass TorchTitan's
validation.

Measured (fp32, CPU): logits within 4.8e-7 (torchtitan) and 4.2e-7 (megatron) of transformers'; the exports are
bit-equal; over 6 steps (4 layers) TorchTitan's losses within 1.3e-7 relative of megatron's, grad norms 5.1e-6; the
two-rank layouts' losses within 1.3e-7 of their engine's one rank, grad norms 1.2e-5; FP8 (bf16 weights, every
linear forced) losses within 2.5e-4 (megatron) and 3.8e-4 (TorchTitan) of fp32's.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import hf_logits, max_diff, roundtrip, run_config, token_ids, train_logged
from safetensors.torch import load_file

ENGINE_TOL = 1e-5


def make_hf_deepseek(folder):
    """transformers' DeepseekV3ForCausalLM with core's config.json of tiny-deepseek, norms and the routing bias
    randomised too, saved to ``folder``."""
    import transformers

    from primus.core.config.presets import model_config
    from primus.core.contracts.plugins import get_registry
    from primus.core.hf.config import hf_config

    cfg = hf_config(model_config("tiny-deepseek", get_registry()))
    config = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return folder


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return make_hf_deepseek(tmp_path_factory.mktemp("deepseek") / "hf")


@pytest.mark.parametrize("backend", ["torchtitan", "megatron"])
def test_import_forward_export(tmp_path, hf_folder, backend):
    ids = token_ids()
    ref = hf_logits(hf_folder, ids)
    logits, exported = roundtrip(run_config(tmp_path / "run.yaml", backend), hf_folder, tmp_path, ids)
    assert max_diff(logits, ref) < ENGINE_TOL

    original, written = hf_tensors(hf_folder), hf_tensors(exported)
    assert sorted(written) == sorted(original)
    assert any(n.endswith("e_score_correction_bias") for n in original)  # the routing bias is carried
    for name, t in original.items():
        assert torch.equal(written[name], t), name
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    assert max_diff(hf_logits(exported, ids), ref) == 0.0


def as_transformers_writes(hf_folder, folder):
    """A copy of ``hf_folder`` whose config.json names one multi-token-prediction depth and holds no weights of it,
    as transformers writes every DeepseekV3Config it was not told otherwise (its default
    num_nextn_predict_layers is 1; its model has no such layer)."""
    import shutil

    import transformers

    assert transformers.DeepseekV3Config().num_nextn_predict_layers == 1
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _first_loss_of_transformers(run_folder, hf_folder) -> float:
    """transformers' loss on the first global batch of the run in ``run_folder`` (core's order: both engines')."""
    import torch.nn.functional as F

    from primus.core.launch.resolve import resolve
    from primus.megatron.data import Batches, primus_dataset

    cfg = resolve(str(run_folder / "config.yaml"), ["train.init_from=null", "model.mtp=null"]).config
    micro = Batches(primus_dataset(cfg), cfg, 0, 1, "cpu").micro_batches(0)
    tokens, labels = torch.cat([t for t, _ in micro]), torch.cat([y for _, y in micro])
    logits = hf_logits(hf_folder, tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()


@pytest.mark.parametrize("backend", ["torchtitan", "megatron"])
def test_init_from_hf_folder(tmp_path, hf_folder, backend):
    """A run of the tiny-deepseek preset starts from the HF folder (checked to match, filled layer by layer): its
    first loss is transformers' loss on the same batch. The folder is as transformers writes it (config.json
    num_nextn_predict_layers 1, no weights of that depth): the run has no multi-token prediction, and says so."""
    folder = as_transformers_writes(hf_folder, tmp_path / "hf")
    config = tmp_path / "run.yaml"
    run_config(config, backend, train={"steps": 2})
    config.write_text(config.read_text().replace("tiny-llama", "tiny-deepseek"))
    from_hf, said = train_logged(config, tmp_path / "hf_run", f"train.init_from={folder}")
    assert "names 1 multi-token-prediction depth(s) (num_nextn_predict_layers) without their weights" in said, said
    assert "mtp_loss" not in from_hf[0]
    expected = _first_loss_of_transformers(tmp_path / "hf_run", folder)
    assert len(from_hf) == 2 and from_hf[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_init_from_hf_folder_with_its_prediction_depth_on_megatron(tmp_path, hf_folder):
    """A folder that holds the weights of the depth its config.json names starts a run with model.mtp on (megatron;
    TorchTitan builds no multi-token prediction): ``mtp_loss`` is logged, and the main loss of step 1 is still
    transformers' (which reads no such depth)."""
    from safetensors.torch import save_file

    from primus.core.hf.config import model_config_from_hf
    from primus.core.hf.contract import mtp_names
    from primus.core.run import initial_weights as init

    folder = as_transformers_writes(hf_folder, tmp_path / "hf")
    m = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    save_file({n: init.tensor(n, m, 7) for n in mtp_names(m, 0).values()}, folder / "mtp.safetensors")
    config = tmp_path / "run.yaml"
    run_config(config, "megatron", train={"steps": 2})
    config.write_text(config.read_text().replace("tiny-llama", "tiny-deepseek"))
    rows, said = train_logged(config, tmp_path / "hf_run", f"train.init_from={folder}")
    assert "without their weights" not in said and "mtp_loss" in rows[0]
    assert rows[0]["loss"] == pytest.approx(_first_loss_of_transformers(tmp_path / "hf_run", folder), rel=1e-5)


@pytest.mark.parametrize(
    ("backend", "override", "key"),
    [
        ("torchtitan", {"moe": {"layer_frequency": 2}}, "model.moe.layer_frequency"),
        (
            "torchtitan",
            {"rope_scaling": {"type": "yarn", "mscale": 0.5, "mscale_all_dim": 1.0}},
            "model.rope_scaling.mscale",
        ),
        ("torchtitan", {"mtp": {"layers": 1}}, "model.mtp"),
    ],
)
def test_engine_refuses_what_it_cannot_build(backend, override, key):
    from primus.core.config.errors import ConfigError
    from primus.core.config.presets import model_config
    from primus.core.config.validate import validate_config
    from primus.core.contracts.plugins import get_registry

    model = model_config("tiny-deepseek", get_registry()).model_dump(mode="json")
    for k, v in override.items():
        model[k] = {**model[k], **v} if isinstance(model.get(k), dict) else v
    with pytest.raises(ConfigError) as info:
        validate_config({"model": model, "backend": {"name": backend}}, world_size=1, registry=get_registry())
    assert key in str(info.value), str(info.value)


STEPS = 6
LOSS_RTOL, GNORM_RTOL = 2e-5, 5e-4  # tests/test_moe_same_run.py's
RECIPE = {
    "extends": ["tiny-deepseek"],
    # the routing bias is in both models (zeros from the canonical init, used in the choice of experts) and not
    # updated: the two engines' bias updates differ (torchtitan centres its update, megatron does not); 4 layers (the
    # dense one, 3 MoE) so that 2 pipeline stages split them evenly, as megatron requires
    "model": {"num_layers": 4, "moe": {"balancing": "none"}},
    "train": {
        "seq_len": 64,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "steps": STEPS,
        "precision": "fp32",
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 2, "decay": "cosine"},
    },
    "data": {"source": "bundled", "tokenizer": "bundled"},
    "logging": {"interval": 1, "tensorboard": False, "progress": False},
    "checkpoint": {"enabled": False},
}


# megatron takes TP only with sequence parallelism for MoE and MLA (primus.megatron.deepseek), and refuses FSDP2 of
# experts
RUNS = {
    "megatron": ("megatron", 1, []),
    "torchtitan": ("torchtitan", 1, []),
    "megatron-ep2": ("megatron", 2, ["parallel.ep=2"]),
    "torchtitan-ep2": ("torchtitan", 2, ["parallel.ep=2"]),
    "torchtitan-tp2": ("torchtitan", 2, ["parallel.tp=2"]),
    "megatron-tp2": ("megatron", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "megatron-pp2": ("megatron", 2, ["parallel.pp=2"]),
    "torchtitan-pp2": ("torchtitan", 2, ["parallel.pp=2"]),
    "torchtitan-fsdp2": ("torchtitan", 2, ["parallel.dp_shard=2"]),
}
# FP8 on latent attention's projections (and the dense MLPs, the shared expert; the routed experts stay bf16, core's
# rule on a CPU): every linear forced, bf16 weights, against the engine's fp32 curve
FP8 = ["train.precision=bf16", "kernels.fp8=rowwise", "kernels.fp8_recipe.linears=all"]
RUNS |= {"megatron+fp8": ("megatron", 1, FP8), "torchtitan+fp8": ("torchtitan", 1, FP8)}
# multi-token prediction (megatron only): one depth, on one rank, under TP 2 + SP and under PP 2 (the depth on the
# last stage with its own copy of the embedding)
MTP = ["model.mtp.layers=1"]
RUNS |= {"megatron+mtp": ("megatron", 1, MTP), "megatron+mtp-tp2": ("megatron", 2, [*MTP, *RUNS["megatron-tp2"][2]])}
RUNS |= {"megatron+mtp-pp2": ("megatron", 2, [*MTP, "parallel.pp=2"])}
LOGS: dict[str, str] = {}


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> dict[str, list[dict]]:
    import yaml

    root = tmp_path_factory.mktemp("deepseek_same_run")
    out = {}
    for name, (backend, nproc, overrides) in RUNS.items():
        config = root / f"{name}.yaml"
        config.write_text(yaml.safe_dump(RECIPE | {"backend": {"name": backend}}, sort_keys=False))
        out[name], LOGS[name] = train_logged(config, root / name, *overrides, nproc=nproc)
    return out


def test_same_loss_curve_on_both_engines(curves):
    """MLA, the sigmoid router with its bias and group-limited top-k, the routed scaling factor, a shared expert and
    a dense first layer, from core's canonical weights: the same curve on megatron-core and TorchTitan."""
    ref, rows = curves["megatron"], curves["torchtitan"]
    losses = [r["loss"] for r in ref]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.4, losses  # it trains
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL)


# megatron is not planned here: it splits 61 layers (a prime) over pipeline stages evenly only and refuses FSDP2 of
# experts; the best layout without those (distributed optimizer, TP 4 + SP, EP 64, full recompute) is planned at 124
# GiB of the H200's 114 with headroom (`primus plan` says so, naming the refusals)
@pytest.mark.parametrize("engine", ["torchtitan"])
def test_plan_deepseek_v3_on_32_h200_nodes_is_accepted(engine):
    """``primus plan deepseek-v3 --device H200 --nodes 32``: the layouts it shows (the first its recommendation)
    pass core's and the engine's validation at 256 ranks (it proposed PP 32 × VPP 2 for 61 layers before)."""
    from primus.core.config.validate import validate_config
    from primus.core.contracts.engine import validate_with
    from primus.core.contracts.plugins import get_registry
    from primus.core.launch.cluster_plan import global_batch, rank, resolve_on
    from primus.core.launch.resolve import searched_micro_batches
    from primus.core.planner import Cluster, device
    from primus.core.planner.auto import layout_config
    from primus.core.planner.calibration import HEADROOM
    from primus.core.planner.engine_profile import backend_spec

    registry = get_registry()
    res, _ = resolve_on("deepseek-v3", [f"backend.name={engine}"], 256, registry)
    cluster = Cluster(device("H200"), 32, 8, HEADROOM)
    ranked = rank(res.config, cluster, engine, registry, searched_micro_batches(res), global_batch(res))
    shown = [c for c in ranked if c.runnable][:10]
    assert shown, f"no layout of deepseek-v3 fits 32×8 H200 on {engine}"
    for c in shown:
        run = layout_config(res.config, c.layout)
        assert validate_with(backend_spec(engine), run, 256) == [], c.layout.describe()
        validate_config(run.model_dump(), world_size=256, registry=registry)
        assert c.layout.ep > 1 and c.memory.total <= cluster.budget


@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_fp8_on_latent_attention_tracks_the_fp32_curve(curves, engine):
    """``kernels.fp8=rowwise`` with every linear forced: MLA's up projections and its output projection run as FP8
    linears, its down projections too on TorchTitan (megatron-core takes only its own classes there), as the kernel
    log says, and the losses stay within 1% of the engine's fp32 curve (measured: see the module docstring), not
    equal to it."""
    log, ref, got = LOGS[f"{engine}+fp8"], curves[engine], curves[f"{engine}+fp8"]
    if engine == "megatron":  # the kernel log's blocks, with no linear left bf16 (linears: all)
        assert "fp8 (rowwise): FP8 linears in blocks [0, 1, 2, 3]" in log, log[-3000:]
    else:  # 4 blocks x (q_a, q_b, kv_a, kv_b, o) + the dense MLP (3) + 3 shared experts (3 each)
        assert "fp8 (fp8, rowwise): 32 linears swapped" in log, log[-3000:]
    losses, fp32 = [r["loss"] for r in got], [r["loss"] for r in ref]
    assert losses[-1] < losses[0] - 0.4 and losses != fp32
    assert losses == pytest.approx(fp32, rel=0.01)


@pytest.mark.parametrize("name", [n for n in RUNS if "-" in n])
def test_two_ranks_train_the_one_rank_curve(curves, name):
    """EP 2 (experts split over 2 gloo ranks, all-to-all dispatch), TP 2 (MLA's up and output projections split, its
    down projections whole; TorchTitan splits the experts, megatron keeps them whole on each rank and routes each
    rank's sequence-parallel half of the tokens), PP 2 (the dense layer and an MoE one a stage) and TorchTitan's FSDP 2
    (every weight, the experts' too, sharded over the 2 ranks): the single-rank curve of the engine; with multi-token
    prediction its loss too."""
    ref, rows = curves[name.split("-")[0]], curves[name]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=LOSS_RTOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=GNORM_RTOL)
    if "mtp_loss" in ref[0]:
        assert [r["mtp_loss"] for r in rows] == pytest.approx([r["mtp_loss"] for r in ref], rel=LOSS_RTOL)


def test_multi_token_prediction_trains_beside_the_main_loss(curves):
    """model.mtp on megatron: the main loss of step 1 is the run without MTP's (the same forward), its gradient is
    not (MTP's loss, scaled by model.mtp.loss_scale, joins it), and ``mtp_loss`` (predicting the token after next)
    is logged every step, falling."""
    plain, mtp = curves["megatron"], curves["megatron+mtp"]
    assert mtp[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert mtp[0]["grad_norm"] != pytest.approx(plain[0]["grad_norm"], rel=1e-4)
    losses = [r["mtp_loss"] for r in mtp]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.3, losses
    assert losses != [r["loss"] for r in mtp]  # another prediction than the main model's
    assert "mtp_loss" not in plain[0]


def test_multi_token_prediction_weights_round_trip_on_megatron(tmp_path, hf_folder):
    """A DeepSeek-V3 folder with a multi-token-prediction depth (config.json num_nextn_predict_layers 1; layer
    num_layers's block and its enorm, hnorm, eh_proj and shared_head.norm, random here: transformers builds none)
    imports into megatron (model.mtp from config.json) and exports every tensor bit for bit; without the depth's
    weights model.mtp is left off (as transformers writes the key), and a run may leave them unread
    (model.mtp=null)."""
    import shutil
    import subprocess
    import sys

    from safetensors.torch import save_file

    from primus.core.hf.config import model_config_from_hf
    from primus.core.hf.contract import mtp_names
    from primus.core.run import initial_weights as init

    folder = tmp_path / "hf_mtp"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    m = model_config_from_hf(config)
    save_file({n: init.tensor(n, m, 7) for n in mtp_names(m, 0).values()}, folder / "mtp.safetensors")
    run = run_config(tmp_path / "run.yaml", "megatron")
    code = (
        "import sys\nfrom pathlib import Path\nfrom primus.core.launch.resolve import config_with_hf_model\n"
        "from primus.core.hf.contract import export_checkpoint, import_checkpoint\n"
        "from primus.core.run.checkpoints import readable\n"
        "run, hf, ckpt, out, *overrides = sys.argv[1:]\ncfg = config_with_hf_model(run, overrides, hf)\n"
        "print('mtp', cfg.model.mtp)\nexport_checkpoint(cfg, readable(import_checkpoint(cfg, hf, Path(ckpt))), out)\n"
    )

    def roundtrip(hf, name, *overrides):
        out = tmp_path / name
        args = [sys.executable, "-c", code, str(run), str(hf), str(tmp_path / f"{name}_ckpt"), str(out), *overrides]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out, proc.stdout

    exported, said = roundtrip(folder, "exported")
    assert "mtp layers=1" in said, said
    original, written = hf_tensors(folder), hf_tensors(exported)
    assert sorted(written) == sorted(original) and f"model.layers.{m.num_layers}.eh_proj.weight" in written
    for name, t in original.items():
        assert torch.equal(written[name], t), name
    assert json.loads((exported / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # the run's own model.mtp=null: the depth left unread; transformers' folder (key 1, no weights): no model.mtp
    dropped, said = roundtrip(folder, "dropped", "model.mtp=null")
    assert "mtp None" in said and sorted(hf_tensors(dropped)) == sorted(hf_tensors(hf_folder))
    (folder / "mtp.safetensors").unlink()
    _, said = roundtrip(folder, "no_weights")
    assert "mtp None" in said
