"""``primus checkpoint import --from PATH`` of checkpoints Megatron-LM's trainer wrote (the megatron backend's side:
:mod:`primus.megatron.native` recognises them, the engine's ``load_native`` loads them,
:mod:`primus.megatron.native_load`).

The sources are written as Megatron-LM's ``save_checkpoint`` writes them (tests/fixtures/megatron_lm_trainer.py:
megatron-core 0.16.1's own ``get_gpt_layer_local_spec`` / ``get_gpt_decoder_block_spec``, ``GPTModel``, DDP,
``get_megatron_optimizer``, the state dict of ``generate_state_dict`` saved by ``dist_checkpointing.save`` in
torch_dist, ``latest_checkpointed_iteration.txt``; norms and biases randomised), fp32 on the CPU, with megatron's
logits over fixed tokens and, for two of them, its losses over two more steps on the batches Primus's resumed run
reads. A Llama at TP 2 on 2 gloo processes (2 steps; the distributed optimizer's state in ``fully_reshardable`` and,
beside it, in Megatron-LM's default ``dp_reshardable``); then, at world size 1, one step each of Qwen2 (q/k/v biases;
saved without optimizer state, as ``--no-save-optim``), Qwen3 (q/k norms, head_dim 32; megatron's regular optimizer),
Qwen3-MoE (4 experts in every layer: stacked layer keys) with megatron's local key names, and a Mixtral-style MoE and
a DeepSeek-style model (MLA, a shared expert, the sigmoid router with its expert bias, the first layer dense:
per-layer keys) whose sharded keys are renamed to what megatron-core's Transformer Engine spec names them before the
save. That rename stands in for a TE build, which cannot be installed on a CPU
(``get_gpt_layer_with_transformer_engine_spec``: MLA's q / kv norms fused into ``linear_q_up_proj`` /
``linear_kv_up_proj``, the dense layer's pre-MLP norm into ``linear_fc1``, a MoE layer's its own
``pre_mlp_layernorm``). Then every ``primus`` command runs in one child process (tests/fixtures/primus_commands.py):
imports to Hugging Face folders, whose logits in transformers must be megatron's; imports into Primus runs that
``primus train --resume`` continues with the source's Adam state (the Llama's with the distributed optimizer, as on
several GPUs); the refusals, one line each.

Measured (fp32, CPU): transformers' logits of each import vs megatron's of its source: the TP 2 Llama 2.4e-7, Qwen2
2.4e-7, Qwen3 2.5e-7, Qwen3-MoE 2.4e-7, Mixtral (TE names) 1.8e-7, DeepSeek (TE names) 1.8e-7; the resumed runs'
losses vs the sources' own continuations: within 4.8e-7 (7.5602 and 7.5467 for the Llama). The second resumed step
depends on the carried Adam state: with the moments zeroed it was 2.4e-2 off, with the update count 1 instead of 2
7.8e-3 off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_helpers import hf_logits, max_diff, run_config, token_ids
from support import ok, primus_commands, refused

FIXTURES = Path(__file__).parent / "fixtures"
LOGIT_TOL = 1e-5  # transformers' logits of the import vs megatron's of the source, fp32 (measured <= 4.8e-7)
LOSS_TOL = 1e-5  # the resumed run vs the source's continuation, fp32, TP 2 vs TP 1 (measured <= 2e-6)

# Megatron-LM's arguments (the names its argparse namespace holds) of a tiny Llama, fp32, on the CPU
LLAMA = {
    **{"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176, "num_attention_heads": 4, "kv_channels": 16},
    **{"group_query_attention": True, "num_query_groups": 2, "max_position_embeddings": 256, "seq_length": 32},
    **{"padded_vocab_size": 2048, "position_embedding_type": "rope", "rotary_base": 10000, "rotary_percent": 1.0},
    **{"rotary_interleaved": False, "use_rope_scaling": False, "rope_scaling_factor": 8.0, "rope_type": None},
    **{"normalization": "RMSNorm", "layernorm_epsilon": 1e-5, "apply_layernorm_1p": False, "swiglu": True},
    **{"untie_embeddings_and_output_weights": True, "add_bias_linear": False, "add_qkv_bias": False},
    **{"squared_relu": False, "qk_layernorm": False, "num_experts": None, "multi_latent_attention": False},
    **{"mtp_num_layers": None, "init_method_std": 0.02, "bf16": False, "fp16": False, "transformer_impl": "local"},
    **{"use_legacy_models": False, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
    **{"virtual_pipeline_model_parallel_size": None, "expert_model_parallel_size": 1, "context_parallel_size": 1},
    **{"sequence_parallel": False, "use_distributed_optimizer": True, "ckpt_format": "torch_dist"},
    **{"no_save_optim": False, "no_save_rng": False, "seed": 1234, "train_iters": 10},
    # the optimizer of the Primus run that continues it (hf_helpers.run_config): constant LR, no decay or clipping
    **{"lr": 3e-3, "min_lr": 3e-3, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8},
    **{"clip_grad": 0.0, "micro_batch_size": 4, "global_batch_size": 4},
    # megatron's fused paths need a GPU
    **{"hidden_dropout": 0.0, "attention_dropout": 0.0, "masked_softmax_fusion": False, "bias_dropout_fusion": False},
    **{"apply_rope_fusion": False, "gradient_accumulation_fusion": False},
}
MOE = {
    **{"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_layer_freq": 1},
    **{"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3, "moe_router_pre_softmax": False},
    **{"moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": False},
}
FAMILIES = {  # name -> (Megatron-LM arguments, TE key names, HF model_type of the export)
    "qwen2": ({**LLAMA, "add_qkv_bias": True, "layernorm_epsilon": 1e-6, "no_save_optim": True}, False, "qwen2"),
    # megatron's regular optimizer (no --use-distributed-optimizer): its state per model tensor, no fp32 copies
    "qwen3": (
        {**LLAMA, "qk_layernorm": True, "kv_channels": 32, "rotary_base": 1000000, "use_distributed_optimizer": False},
        False,
        "qwen3",
    ),
    "qwen3-moe": ({**LLAMA, **MOE, "qk_layernorm": True, "kv_channels": 32}, False, "qwen3_moe"),
    "mixtral": ({**LLAMA, **MOE}, True, "mixtral"),
    "deepseek": (
        {
            **LLAMA,
            **MOE,
            **{"multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": 32, "kv_lora_rank": 32},
            **{"qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "rope_type": "rope"},
            **{"moe_layer_freq": [0, 1], "moe_shared_expert_intermediate_size": 32, "moe_router_pre_softmax": False},
            **{"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
            **{"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4},
            **{"moe_router_topk_scaling_factor": 2.5, "moe_router_dtype": "fp32"},
            # DeepSeek-V3's epsilon: transformers' DeepseekV3 gives its latent q / kv norms 1e-6 whatever
            # rms_norm_eps says (megatron the model's epsilon), so another one would not export exactly
            "layernorm_epsilon": 1e-6,
        },
        True,
        "deepseek_v3",
    ),
}


# the sources a Primus run continues: to this step (two past the source's), with these settings (the import is one
# process with megatron's regular optimizer; the Llama's run takes that state into the distributed optimizer, as a
# run on several GPUs does)
RESUMED = {"llama": (4, ["parallel.distributed_optimizer=true"]), "qwen3": (3, [])}


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PRIMUS_LAUNCHED", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


def _trainers(spec: Path, logs: Path, nproc: int) -> list[tuple[subprocess.Popen, Path]]:
    """The Megatron-LM stand-in on ``nproc`` processes (torchrun's environment, without its agent process)."""
    from primus.core.launch.env import free_port

    world = {"WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = []
    for rank in range(nproc):
        log = logs / f"rank{rank}.log"
        env = {**_env(), **world, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        cmd = [sys.executable, str(FIXTURES / "megatron_lm_trainer.py"), str(spec)]
        procs.append((subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env), log))
    return procs


def _wait(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    for proc, log in procs:
        if proc.wait(timeout=300) != 0:
            pytest.fail(f"the Megatron-LM stand-in exited {proc.returncode} (log {log}):\n{log.read_text()[-5000:]}")


def _batches(config: Path, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (tokens, labels) of steps 1..``steps`` of a one-rank Primus run of ``config``: the source
    trains on them, so the resumed run's steps after the source's read what the source's continuation read."""
    from primus.core.launch.resolve import resolve
    from primus.megatron.data import Batches, primus_dataset

    cfg = resolve(str(config), [], world_size=1).config
    batches = Batches(primus_dataset(cfg), cfg, 0, 1, "cpu")
    return [tuple(torch.cat(part) for part in zip(*batches.micro_batches(s), strict=True)) for s in range(steps)]


def _refusal_folders(root: Path, real: Path) -> dict[str, Path]:
    """An iter folder in the legacy torch format, a torch_dist folder without Megatron-LM's arguments and one whose
    arguments say a model Primus does not build (linear biases), the last two with ``real``'s tensor index."""
    legacy = root / "legacy" / "iter_0000005" / "mp_rank_00"
    legacy.mkdir(parents=True)
    torch.save({"iteration": 5}, legacy / "model_optim_rng.pt")
    (root / "legacy" / "latest_checkpointed_iteration.txt").write_text("5")
    out = {"legacy": root / "legacy", "no-args": root / "no-args" / "iter_0000003"}
    out["biases"] = root / "biases" / "iter_0000002"
    for name, common in (
        ("no-args", {"iteration": 3, "checkpoint_version": 3.0}),
        ("biases", {"iteration": 2, "args": argparse.Namespace(**{**LLAMA, "add_bias_linear": True})}),
    ):
        out[name].mkdir(parents=True)
        for f in ("metadata.json", ".metadata"):
            shutil.copy(real / f, out[name] / f)
        torch.save(common, out[name] / "common.pt")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The sources (the TP 2 Llama on two processes, then the families on the first alone), then every ``primus``
    command of the tests in one child process: name -> {"args", "rc", "out"}; plus the folders."""
    root = tmp_path_factory.mktemp("native-megatron")
    config = run_config(root / "run.yaml", "megatron")
    torch.save(_batches(config, 4), root / "batches.pt")
    torch.save(token_ids(batch=2, seq=32), root / "ids.pt")
    common = {"batches": str(root / "batches.pt"), "ids": str(root / "ids.pt")}
    llama = {"root": str(root / "llama"), "args": {**LLAMA, "tensor_model_parallel_size": 2}, "steps": 2}
    llama |= {"continue": 2, "sharding": ["fully_reshardable", "dp_reshardable"]}
    families = [
        {"root": str(root / name), "args": args, "steps": 1, "te_names": te, "continue": 2 * (name == "qwen3")}
        for name, (args, te, _) in FAMILIES.items()
    ]
    stages = [{"world": 2, "tp": 2, "models": [llama]}, {"world": 1, "models": families}]
    (root / "sources.json").write_text(json.dumps({**common, "stages": stages}))
    _wait(_trainers(root / "sources.json", root, nproc=2))

    refuse = _refusal_folders(root / "refused", root / "llama" / "iter_0000002")
    out = {name: root / name for name in ("resumed-llama", "resumed-qwen3", "weights", "hf-llama")}
    commands = {
        **{
            f"import-{name}": [
                *("checkpoint", "import", str(config), "--from", str(root / name)),
                f"logging.output_dir={out[f'resumed-{name}']}",
            ]
            for name in RESUMED
        },
        **{
            f"resume-{name}": [
                *("train", str(out[f"resumed-{name}"] / "config.yaml"), "--resume", f"train.steps={steps}", *words),
            ]
            for name, (steps, words) in RESUMED.items()
        },
        # no train.precision: the sources are fp32, which the checkpoint implies (NativeCheckpoint.overrides)
        "to-hf": ["checkpoint", "import", "--from", str(root / "llama"), "--to-hf", str(out["hf-llama"])],
        "dp-reshardable": [
            *("checkpoint", "import", str(config), "--from", str(root / "llama-dp_reshardable")),
            f"logging.output_dir={out['weights']}",
        ],
        **{
            f"family-{name}": [
                "checkpoint",
                "import",
                "--from",
                str(root / name),
                "--to-hf",
                str(root / f"hf-{name}"),
            ]
            for name in FAMILIES
        },
        **{f"refuse-{name}": ["checkpoint", "import", "--from", str(path)] for name, path in refuse.items()},
    }
    done = primus_commands(root, commands, _env())
    return {"root": root, "config": config, "refuse": refuse, **out, **done}


def test_recognised_from_file_names_and_arguments(runs):
    """The save folder resolves to its newest iteration; the model is Megatron-LM's arguments; the optimizer state is
    carried over where it is per model tensor (``fully_reshardable``) and not where it follows the saving run's
    gradient buckets (``dp_reshardable``); nothing of megatron is imported to tell."""
    from primus.core.contracts.plugins import get_registry
    from primus.core.launch.native import recognise

    loaded = "megatron" in sys.modules
    backend, found = recognise(runs["root"] / "llama", get_registry())
    assert backend == "megatron" and found.source == "Megatron-LM" and found.problem is None
    assert found.folder == runs["root"] / "llama" / "iter_0000002" and found.step == 2 and found.optimizer
    assert found.model == {
        **{"name": "llama", "family": "llama", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4},
        **{"num_kv_heads": 2, "head_dim": None, "ffn_hidden_size": 176, "vocab_size": 2048, "rope_theta": 10000.0},
        **{"max_position_embeddings": 256, "rope_scaling": None, "norm_eps": 1e-5, "tie_word_embeddings": False},
        **{"qkv_bias": False, "qk_norm": False, "init_std": 0.02, "moe": None, "mla": None, "mtp": None},
    }
    assert found.details["layout"]["tp"] == 2 and found.details["adam_step"] == 2.0
    assert "iteration 2 (llama, 2 layers, hidden 64; fp32; saved at TP 2;" in found.what
    _, bucketed = recognise(runs["root"] / "llama-dp_reshardable", get_registry())
    assert not bucketed.optimizer and bucketed.problem is None
    assert "dp_reshardable, Megatron-LM's default" in bucketed.optimizer_dropped
    for name in FAMILIES:
        assert recognise(runs["root"] / name / "iter_0000001", get_registry())[1].model["family"] == (
            "mistral" if name == "mixtral" else name.split("-")[0]
        )
    assert loaded or "megatron" not in sys.modules


def test_tp2_checkpoint_to_hf_gives_megatron_logits(runs):
    """``primus checkpoint import --from ROOT --to-hf DIR`` of the Llama saved at TP 2: transformers' logits over
    the folder are megatron's own over the source."""
    said = ok(runs["to-hf"])
    assert "found Megatron-LM torch_dist checkpoint, iteration 2" in said and "exported" in said
    ids = token_ids(batch=2, seq=32)
    assert max_diff(hf_logits(runs["hf-llama"], ids), torch.load(runs["root"] / "llama" / "logits.pt")) < LOGIT_TOL


@pytest.mark.parametrize("name", RESUMED)
def test_import_resumes_with_the_source_adam_state(runs, name):
    """Imported into a run folder, a checkpoint with carried optimizer state (the TP 2 Llama's distributed optimizer,
    ``fully_reshardable``; Qwen3's regular optimizer) is the source's iteration with it, and ``primus train
    <out>/config.yaml --resume`` continues it (the Llama's with the distributed optimizer): the first step's loss is
    the source's weights' on that batch, the second's (after an update through the carried Adam moments and step
    count) the source's own continuation's."""
    from primus.core.run.checkpoints import read_manifest

    said = ok(runs[f"import-{name}"])
    out, start = runs[f"resumed-{name}"], RESUMED[name][0] - 2
    assert f"continue it with: primus train {out / 'config.yaml'} --resume" in said
    man = read_manifest(out / "checkpoints" / f"step_{start:08d}")
    assert man["step"] == start and man["applied_steps"] == start and "weights_only" not in man
    assert man["imported"]["source"] == "Megatron-LM" and man["imported"]["step"] == start
    ok(runs[f"resume-{name}"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    source = json.loads((runs["root"] / name / "losses.json").read_text())
    assert [r["step"] for r in rows if "loss" in r] == [start + 1, start + 2]
    resumed = [r["loss"] for r in rows if "loss" in r]
    assert resumed == pytest.approx(source, rel=LOSS_TOL, abs=0), (resumed, source)


def test_bucketed_optimizer_state_imports_the_weights_alone(runs):
    """``dp_reshardable`` (Megatron-LM's default): the weights are imported, the reason is said, nothing else."""
    said = ok(runs["dp-reshardable"])
    assert "not carried over" in said and "--dist-ckpt-optim-fully-reshardable" in said
    assert "train.init_from=" in said
    assert (runs["weights"] / "imported" / "step_00000002" / "manifest.json").is_file()


@pytest.mark.parametrize("name", FAMILIES)
def test_family_imports_with_megatron_logits(runs, name):
    """Each family (megatron's local key names, or Transformer Engine's for Mixtral and DeepSeek) to HF: the
    family's transformers class, megatron's logits."""
    ok(runs[f"family-{name}"])
    hf = runs["root"] / f"hf-{name}"
    assert json.loads((hf / "config.json").read_text())["model_type"] == FAMILIES[name][2]
    ids = token_ids(batch=2, seq=32)
    assert max_diff(hf_logits(hf, ids), torch.load(runs["root"] / name / "logits.pt")) < LOGIT_TOL


def test_refusals_name_the_path_and_what_is_expected(runs):
    """A legacy ``--ckpt-format torch`` iteration, a torch_dist folder without Megatron-LM's arguments, arguments of a
    model Primus does not build: exit 2, one line saying what the path is and what would import."""
    legacy = refused(runs["refuse-legacy"])
    assert "legacy torch format, iteration 5" in legacy and "mp_rank_00/model_optim_rng.pt" in legacy
    assert "Primus imports the torch_dist format" in legacy and "--ckpt-convert-format torch_dist" in legacy
    no_args = refused(runs["refuse-no-args"])
    assert "without Megatron-LM's arguments" in no_args and "expected a Megatron-LM torch_dist checkpoint" in no_args
    biases = refused(runs["refuse-biases"])
    assert "does not build biases on the linear layers" in biases and "add_bias_linear True" in biases
