"""``primus checkpoint import --from PATH`` of checkpoints plain TorchTitan 0.2.2 wrote (the torchtitan backend's side:
:mod:`primus.torchtitan.native` recognises them, the engine's ``load_native`` loads them).

The sources are made by TorchTitan's own trainer and checkpointer (``torchtitan.train.Trainer``, tests/fixtures/
torchtitan_trainer.py): torchtitan's debug flavors made small, 2 or 3 steps, fp32 on the CPU: llama3 (the debugmodel
cut to 2 layers; a full save at step 2, the run's last save model-only at step 3, as torchtitan's default
``last_save_model_only`` has it), the same from 2 gloo processes with FSDP, qwen3 dense (its last save in Hugging Face
safetensors), qwen3 MoE and deepseek_v3 in the tiny-qwen3 / tiny-qwen3-moe / tiny-deepseek presets' shapes. The
trainer also gives torchtitan's own logits of each saved model over fixed tokens. Then ``primus`` (every command in one
child process, tests/fixtures/primus_commands.py) imports them: to Hugging Face folders, whose logits in transformers
must be the source's; to a Primus checkpoint that ``primus train --resume`` continues with the source's Adam state;
and the refusals, one line each.

Measured (fp32, CPU): transformers' logits of the import vs torchtitan's of the source: llama3 9.5e-7 (torchtitan's
complex-pair RoPE, as in test_hf_roundtrip.py), the FSDP source 4.8e-7, qwen3 0.0, qwen3 MoE 0.0, deepseek_v3
3.8e-6 (torchtitan's deepseek_v3 gives its final RMSNorm torch's default epsilon, Primus and transformers the
model's 1e-6; with that epsilon set, 9.5e-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hf_helpers import hf_logits, max_diff, run_config
from support import ok, primus_commands, refused

FIXTURES = Path(__file__).parent / "fixtures"
LOGIT_TOL = 1e-5  # transformers' logits of the import vs torchtitan's of the source, fp32 (measured <= 3.8e-6)

# torchtitan's flavors, made small (model-args fields changed), and what each run saves
LLAMA = {"model": "llama3", "flavor": "debugmodel", "changes": {"n_layers": 2}}
QWEN3 = {  # the tiny-qwen3 preset's shape
    "model": "qwen3",
    "flavor": "debugmodel",
    "changes": {
        **{"n_layers": 2, "dim": 128, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "hidden_dim": 352},
        **{"norm_eps": 1e-6, "enable_weight_tying": False},
    },
}
QWEN3_MOE = {  # tiny-qwen3-moe's: 8 experts of width 64, 2 per token (torchtitan's routing bias, loss-free)
    "model": "qwen3",
    "flavor": "debugmodel_moe",
    "changes": {
        **QWEN3["changes"],
        "moe_inter_dim": 64,
        "moe_args": {"num_experts": 8, "top_k": 2, "use_grouped_mm": False},
    },
}
DEEPSEEK = {  # tiny-deepseek's, without YaRN (torchtitan applies it only past its original context)
    "model": "deepseek_v3",
    "flavor": "debugmodel",
    "changes": {
        **{"dim": 128, "inter_dim": 352, "moe_inter_dim": 64, "n_layers": 3, "n_dense_layers": 1, "n_heads": 4},
        **{"norm_eps": 1e-6, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16},
        **{"v_head_dim": 32, "rope_theta": 10000.0},
        "moe_args": {
            **{"num_experts": 16, "num_shared_experts": 1, "top_k": 4, "score_func": "sigmoid", "route_norm": True},
            **{"route_scale": 2.5, "num_expert_groups": 4, "num_limited_groups": 2, "use_grouped_mm": False},
        },
    },
}
FULL_LAST = ["--training.steps", "2", "--checkpoint.no-last-save-model-only"]  # step 2 with the optimizer state
HF_LAST = "--checkpoint.last_save_in_hf"  # the last save in safetensors (model only)
# the Primus config of the llama source's model (torchtitan's llama3 always scales RoPE, by its defaults here)
LLAMA_MODEL = {
    **{"name": "titan-llama3-debugmodel", "hidden_size": 256, "num_layers": 2, "num_attention_heads": 16},
    **{"num_kv_heads": 16, "ffn_hidden_size": 768, "rope_theta": 500000.0, "max_position_embeddings": 131072},
    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
}
# the other families: their Primus configs (presets) and the step imported (qwen3's last save is in safetensors)
FAMILIES = {
    "qwen3": (["tiny-qwen3"], "step-1"),
    "qwen3-moe": (["tiny-qwen3-moe", "model.moe.balancing=loss_free"], "step-2"),
    "deepseek": (["tiny-deepseek", "model.rope_scaling=null"], "step-2"),
}


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PRIMUS_LAUNCHED", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "HF_DATASETS_OFFLINE": "1"}


def _trainer(log: Path, *jobs: dict, nproc: int = 1) -> subprocess.Popen:
    cmd = [sys.executable, str(FIXTURES / "torchtitan_trainer.py"), *map(json.dumps, jobs)]
    if nproc > 1:
        from primus.core.launch.env import free_port

        cmd[1:1] = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env())


def _wait(procs: dict[Path, subprocess.Popen]) -> None:
    """Each process to its end (killed past 5 minutes); the test fails naming the log of any that failed."""
    for proc in procs.values():
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for log, proc in procs.items():
        if proc.returncode != 0:
            pytest.fail(f"torchtitan's trainer exited {proc.returncode} (log {log}):\n{log.read_text()[-5000:]}")


def _other_keys_checkpoint(folder: Path) -> Path:
    """A DCP checkpoint of another model's keys (as any torch.distributed.checkpoint user writes one)."""
    import torch.distributed.checkpoint as dcp

    state = {"encoder.embed.weight": torch.zeros(8, 4), "encoder.block.0.proj.weight": torch.zeros(4, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The sources (torchtitan's trainer, one process for the one-rank runs beside torchrun for FSDP), then every
    ``primus`` command of the tests in one child process: name -> {"args", "rc", "out"}; plus the folders."""
    root = tmp_path_factory.mktemp("native-torchtitan")
    src = {name: root / name for name in ("llama", "fsdp", "qwen3", "qwen3-moe", "deepseek")}
    logs = root / "ws1.log", root / "fsdp.log"
    one = _trainer(
        logs[0],
        {**LLAMA, "out": str(src["llama"]), "options": ["--training.steps", "3", "--checkpoint.interval", "2"]},
        {**QWEN3, "out": str(src["qwen3"]), "options": [*FULL_LAST[:2], "--checkpoint.interval", "1", HF_LAST]},
        {**QWEN3_MOE, "out": str(src["qwen3-moe"]), "options": FULL_LAST},
        {**DEEPSEEK, "out": str(src["deepseek"]), "options": FULL_LAST},
    )
    fsdp = {**LLAMA, "out": str(src["fsdp"]), "options": [*FULL_LAST, "--parallelism.data_parallel_shard_degree", "2"]}
    _wait({logs[0]: one, logs[1]: _trainer(logs[1], fsdp, nproc=2)})

    # an async save cut short beside the complete ones: shards, no .metadata (DCP writes it last)
    (src["llama"] / "checkpoint" / "step-4").mkdir()
    (src["llama"] / "checkpoint" / "step-4" / "__0_0.distcp").write_bytes(b"\0" * 64)
    other = _other_keys_checkpoint(root / "other" / "step-5")
    # weight decay other than the source's (torchtitan's 0.1): the import keeps Primus's param groups
    optimizer = {"lr": 3.0e-3, "min_lr": 3.0e-3, "weight_decay": 0.05}
    config = str(run_config(root / "llama.yaml", "torchtitan", LLAMA_MODEL, train={"optimizer": optimizer}))
    llama, ckpt = src["llama"] / "checkpoint", src["llama"] / "checkpoint" / "step-2"
    out = {name: root / name for name in ("resumed", "model-only", "fsdp-run", "hf-llama", "hf-fsdp")}
    commands = {
        "to-hf": ["checkpoint", "import", config, "--from", str(ckpt), "--to-hf", str(out["hf-llama"])],
        "import": ["checkpoint", "import", config, f"logging.output_dir={out['resumed']}", "--from", str(ckpt)],
        "resume": ["train", str(out["resumed"] / "config.yaml"), "--resume", "train.steps=3"],
        "model-only": ["checkpoint", "import", config, f"logging.output_dir={out['model-only']}", "--from", str(llama)],
        "fsdp": [
            *("checkpoint", "import", config, "--out", str(out["fsdp-run"] / "step_00000002")),
            *("--from", str(src["fsdp"] / "checkpoint" / "step-2"), "--to-hf", str(out["hf-fsdp"])),
        ],
        **{
            f"family-{name}": [
                *("checkpoint", "import", *words, "--from", str(src[name] / "checkpoint" / step)),
                *("--to-hf", str(root / f"hf-{name}")),
            ]
            for name, (words, step) in FAMILIES.items()
        },
        "other-shape": ["checkpoint", "import", "tiny-llama", "--from", str(ckpt), "--to-hf", str(root / "no")],
        "other-keys": ["checkpoint", "import", "tiny-llama", "--from", str(other), "--to-hf", str(root / "no")],
        "hf-save": ["checkpoint", "import", "tiny-qwen3", "--from", str(src["qwen3"] / "checkpoint")],
        "incomplete": ["checkpoint", "import", config, "--from", str(llama / "step-4"), "--to-hf", str(root / "no")],
        "untied": [
            *("checkpoint", "import", "tiny-qwen3", "model.tie_word_embeddings=true"),
            *("--from", str(src["qwen3"] / "checkpoint" / "step-1"), "--to-hf", str(root / "no")),
        ],
        "no-bias": [
            *("checkpoint", "import", "tiny-qwen3-moe", "model.moe.balancing=none"),
            *("--from", str(src["qwen3-moe"] / "checkpoint"), "--to-hf", str(root / "no")),
        ],
    }
    done = primus_commands(root, commands, _env())
    return {"root": root, "src": src, "out": out, **done}


def read_dcp(folder: Path, keys: list[str]) -> dict:
    """Whole tensors / values of ``keys`` from a DCP checkpoint of any layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) if hasattr(meta[k], "size") else 0 for k in keys
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def test_recognises_torchtitans_folders_and_no_others(runs):
    """A step folder, its checkpoint folder (the newest complete step: step-3, the model alone, past the incomplete
    step-4) and the run's dump folder; never a Primus checkpoint nor a Megatron-Core torch_dist folder."""
    from primus.torchtitan.native import FORMAT

    llama = runs["src"]["llama"]
    found = FORMAT.recognise(llama / "checkpoint" / "step-2")
    assert (found.step, found.optimizer, found.problem) == (2, True, None)
    assert found.what == (
        "TorchTitan checkpoint step-2 (llama3, 2 layers, hidden 256, float32; model, optimizer, LR scheduler, "
        "data loader, train state)"
    )
    for path in (llama / "checkpoint", llama):
        found = FORMAT.recognise(path)
        assert (found.folder.name, found.step, found.optimizer, found.problem) == ("step-3", 3, False, None)
    assert FORMAT.recognise(runs["out"]["resumed"] / "checkpoints" / "step_00000002") is None
    assert FORMAT.recognise(runs["out"]["resumed"]) is None
    megatron = runs["root"] / "megatron" / "iter_0000002"
    megatron.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "metadata.json", "common.pt"):
        (megatron / name).write_bytes(b"{}")
    assert FORMAT.recognise(megatron) is None and FORMAT.recognise(megatron.parent) is None


def test_llama_to_hugging_face_gives_the_source_logits(runs):
    """(a) ``primus checkpoint import CONFIG --from step-2 --to-hf DIR``: LlamaForCausalLM on DIR gives the logits
    of torchtitan's own model of the source."""
    printed = ok(runs["to-hf"])
    assert "found TorchTitan checkpoint step-2 (llama3, 2 layers, hidden 256" in printed
    src = runs["src"]["llama"]
    hf = runs["out"]["hf-llama"]
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert max_diff(hf_logits(hf, torch.load(src / "tokens.pt")), torch.load(src / "logits-step-2.pt")) < LOGIT_TOL


def test_import_resumes_with_the_source_adam_state(runs):
    """(b) The import is a Primus checkpoint at the source's step holding its Adam state (bit for bit, Primus's param
    groups kept: no weight decay on norms) and Primus's own data position at that step; ``primus train --resume``
    continues from step 2, and its step-3 Adam moments are the update of the source's (exp_avg_sq = b2 v2 + (1 - b2)
    g², g recovered from exp_avg), which moments started afresh would not satisfy."""
    import yaml

    assert "continue it with: primus train" in ok(runs["import"])
    run = runs["out"]["resumed"]
    imported = run / "checkpoints" / "step_00000002"
    man = json.loads((imported / "manifest.json").read_text())
    assert (man["step"], man["applied_steps"], man["imported"]["source"]) == (2, 2, "TorchTitan")
    assert man["imported"]["path"] == str(runs["src"]["llama"] / "checkpoint" / "step-2")
    params = ["layers.1.feed_forward.w2.weight", "layers.0.attention_norm.weight", "tok_embeddings.weight"]
    moments = [f"optimizer.state.{p}.{s}" for p in params for s in ("step", "exp_avg", "exp_avg_sq")]
    source = read_dcp(runs["src"]["llama"] / "checkpoint" / "step-2", moments)
    groups = [f"optimizer.param_groups.{p}.weight_decay" for p in params[:2]]
    ours = read_dcp(imported, [*moments, *groups, "dataloader.samples_consumed"])
    for key in moments:
        assert torch.equal(ours[key], source[key]), key
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    decay = cfg["train"]["optimizer"]["weight_decay"]
    assert [ours[g] for g in groups] == [decay, 0.0] and decay == 0.05
    assert ours["dataloader.samples_consumed"] == 2 * cfg["train"]["global_batch_size"]

    printed = ok(runs["resume"])
    summary = json.loads(printed.rsplit("done: ", 1)[1])
    assert (summary["start_step"], summary["final_step"]) == (2, 3)
    after = read_dcp(run / "checkpoints" / "step_00000003", moments)
    b1, b2 = cfg["train"]["optimizer"]["beta1"], cfg["train"]["optimizer"]["beta2"]
    for p in params:
        m2, v2 = source[f"optimizer.state.{p}.exp_avg"], source[f"optimizer.state.{p}.exp_avg_sq"]
        m3, v3 = after[f"optimizer.state.{p}.exp_avg"], after[f"optimizer.state.{p}.exp_avg_sq"]
        assert after[f"optimizer.state.{p}.step"] == 3
        grad = (m3 - b1 * m2) / (1 - b1)
        assert max_diff(v3, b2 * v2 + (1 - b2) * grad * grad) < 1e-6 * v3.abs().max().item(), p
        fresh = m3 / (1 - b1)  # what the moments would say had they started at zero
        assert max_diff(v3, (1 - b2) * fresh * fresh) > 0.1 * v3.abs().max().item(), p


@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_give_the_source_logits(runs, family):
    """(c) qwen3 dense, qwen3 MoE and deepseek_v3, as plain TorchTitan 0.2.2 trains them, through their presets."""
    ok(runs[f"family-{family}"])
    src, step = runs["src"][family], FAMILIES[family][1]
    logits = hf_logits(runs["root"] / f"hf-{family}", torch.load(src / "tokens.pt"))
    assert max_diff(logits, torch.load(src / f"logits-{step}.pt")) < LOGIT_TOL


def test_fsdp_source_imports_the_same(runs):
    """(d) A source saved by 2 gloo processes with FSDP (a shard of each tensor per rank) imports at world size 1:
    the source's logits, and its optimizer state whole."""
    printed = ok(runs["fsdp"])
    assert "imported " in printed and "exported " in printed
    src = runs["src"]["fsdp"]
    assert sorted(p.name for p in (src / "checkpoint" / "step-2").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    logits = hf_logits(runs["out"]["hf-fsdp"], torch.load(src / "tokens.pt"))
    assert max_diff(logits, torch.load(src / "logits-step-2.pt")) < LOGIT_TOL
    keys = [f"optimizer.state.{p}.exp_avg_sq" for p in ("tok_embeddings.weight", "layers.1.attention.wk.weight")]
    source = read_dcp(src / "checkpoint" / "step-2", keys)
    ours = read_dcp(runs["out"]["fsdp-run"] / "step_00000002", keys)
    for key in keys:
        assert torch.equal(ours[key], source[key]), key


def test_refusals_say_what_to_give_in_one_line(runs):
    """(e) What cannot be imported is refused in one line, nothing written; a model-only save imported for a
    resume commits the weights alone and says so."""
    line = refused(runs["other-shape"])
    assert (
        "tok_embeddings.weight is [2048, 256] in the checkpoint (llama3, 2 layers, hidden 256), [2048, 128] in " in line
    )
    assert "model 'tiny-llama' of the config" in line
    line = refused(runs["other-keys"])
    assert "its tensors are not a TorchTitan model's (encoder.embed.weight, encoder.block.0.proj.weight" in line
    line = refused(runs["hf-save"])
    assert "step-2 in Hugging Face safetensors (checkpoint.last_save_in_hf)" in line
    assert "train.init_from=DIR" in line and "--from-hf" in line
    line = refused(runs["incomplete"])
    assert "its save is incomplete" in line and "(step-2, step-3 beside it)" in line
    line = refused(runs["untied"])
    assert "does not tie output.weight to tok_embeddings.weight" in line and "tie_word_embeddings: false" in line
    line = refused(runs["no-bias"])
    assert "layers.0.moe.expert_bias" in line and "model.moe.balancing: loss_free" in line
    assert not (runs["root"] / "no").exists()

    printed = ok(runs["model-only"])
    assert "found TorchTitan checkpoint step-3 (llama3, 2 layers, hidden 256, float32; model)" in printed
    assert (
        "the weights alone (the source holds no optimizer state): start a run from them with train.init_from="
        in printed
    )
    weights = runs["out"]["model-only"] / "imported" / "step_00000003"
    assert json.loads((weights / "manifest.json").read_text())["weights_only"]
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(weights)).read_metadata().state_dict_metadata
    assert "tok_embeddings.weight" in keys and not any(k.startswith("optimizer") for k in keys)
