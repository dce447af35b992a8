"""Hugging Face folders through the CLI, as a user meets them:

- a folder saved by today's ``transformers`` (5.x: the chat template in ``chat_template.jinja``) with its own
  1,503-token tokenizer: ``primus checkpoint import`` records that tokenizer (a copy in the imported checkpoint),
  ``primus checkpoint export`` ships it (not the bundled 2,048-token one), a run started from the imported checkpoint
  takes it, and ``primus train sft`` fine-tunes from the folder with its chat template;
- a Qwen3-MoE folder with shared-expert tensors Primus does not map: import and ``train.init_from`` refuse it
  (exit 2, one line naming the tensors) instead of training without them;
- an expert-parallel run's checkpoint (megatron, EP 2 on 2 ranks) exports with no extra keys, and transformers'
  logits of the export equal the engine's on the checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from hf_helpers import _env, engine_logits, hf_logits, make_hf, max_diff, primus, token_ids, train
from safetensors.torch import load_file, save_file

VOCAB = 1503
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = {
    "train": {"seq_len": 32, "micro_batch_size": 2, "global_batch_size": 4, "steps": 2, "precision": "fp32"},
    "logging": {"interval": 1, "tensorboard": False, "progress": False},
}


def fails(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "primus.core.cli.app", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=240)


def config(path, backend: str, extends: str = "tiny-llama", **sections) -> str:
    """A user's config that does not set data.tokenizer (the preset's default)."""
    body = {"extends": [extends], **TINY, "backend": {"name": backend}}
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value}
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def hf5(tmp_path_factory):
    """A tiny Llama with a 1,503-row embedding and its own BPE tokenizer (1,503 tokens, with a chat template), both
    saved by today's transformers."""
    import itertools

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from primus.core.data import corpus

    folder = make_hf(tmp_path_factory.mktemp("hf5") / "llama-1503", "llama", seed=2, vocab=VOCAB)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(itertools.islice(corpus.documents(), 2000), trainer=trainer)
    assert bpe.get_vocab_size() == VOCAB
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file()
    return folder


def test_import_then_export_carries_the_folders_tokenizer_and_chat_template(hf5, tmp_path):
    import transformers

    imported, exported = tmp_path / "imp", tmp_path / "out"
    cfg = config(tmp_path / "cfg.yaml", "torchtitan")
    primus("checkpoint", "import", cfg, "--from-hf", str(hf5), "--out", str(imported))
    recorded = yaml.safe_load((imported / "config.yaml").read_text())["data"]["tokenizer"]
    assert recorded == str(imported / "tokenizer")  # a copy inside the checkpoint, not "bundled"
    primus("checkpoint", "export", str(imported), "--to-hf", str(exported))
    assert (exported / "tokenizer.json").read_bytes() == (hf5 / "tokenizer.json").read_bytes()
    assert (exported / "chat_template.jinja").read_text() == TEMPLATE
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert len(tok) == VOCAB and tok.chat_template == TEMPLATE
    ids = token_ids(seed=4) % VOCAB
    assert max_diff(hf_logits(exported, ids), hf_logits(hf5, ids)) == 0.0

    # a run started from the imported checkpoint takes its tokenizer, as one started from the folder does
    from primus.core.launch.resolve import resolve

    res = resolve(cfg, [f"train.init_from={imported}"], world_size=1, check_plugins=False)
    assert res.config.data.tokenizer == str(imported / "tokenizer")


def test_sft_from_a_folder_saved_by_transformers_5(hf5, tmp_path):
    data = tmp_path / "chats.jsonl"
    records = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}"},
            ]
        }
        for i in range(40)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    args = ["train", "sft", f"train.init_from={hf5}", f"data.source={data}", "backend.name=torchtitan"]
    args += [
        "train.steps=1",
        "train.schedule.warmup_steps=0",
        "train.seq_len=32",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
    ]
    args += ["train.precision=fp32", "logging.interval=1", "logging.tensorboard=false", f"logging.output_dir={out}"]
    primus(*args, timeout=300)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and 0.0 < rows[0]["loss"] < 20.0
    primus("checkpoint", "export", str(out / "checkpoints"), "--to-hf", str(tmp_path / "out"))
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == TEMPLATE


@pytest.fixture(scope="module")
def shared_experts(tmp_path_factory):
    """A Qwen3-MoE folder with a shared expert per layer (Qwen2-MoE's tensor names) that Primus does not map."""
    folder = make_hf(tmp_path_factory.mktemp("hf") / "moe-shared", "qwen3", moe=True)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    for i in range(2):
        for role in ("gate", "up", "down"):
            shape = (64, 128) if role != "down" else (128, 64)
            tensors[f"model.layers.{i}.mlp.shared_expert.{role}_proj.weight"] = torch.randn(shape)
        tensors[f"model.layers.{i}.mlp.shared_expert_gate.weight"] = torch.randn(1, 128)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return folder


def _one_line_refusal(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "8 tensor(s) of the folder are not part of the model" in proc.stderr
    assert "model.layers.0.mlp.shared_expert.down_proj.weight" in proc.stderr
    return proc.stderr


@pytest.mark.parametrize("backend", ["megatron", "torchtitan"])
def test_unmapped_tensors_are_refused_not_dropped(shared_experts, tmp_path, backend):
    moe = {"model": {"moe": {"balancing": "loss_free"}}} if backend == "torchtitan" else {}
    cfg = config(tmp_path / "cfg.yaml", backend, "tiny-qwen3-moe", **moe)
    err = _one_line_refusal(
        fails("checkpoint", "import", cfg, "--from-hf", str(shared_experts), "--out", str(tmp_path / "i"))
    )
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "i").exists()
    out = tmp_path / "run"
    err = _one_line_refusal(fails("train", cfg, f"train.init_from={shared_experts}", f"logging.output_dir={out}"))
    assert "train.init_from" in err and not (out / "checkpoints").exists()


def test_an_expert_parallel_checkpoint_exports_with_no_extra_keys(tmp_path):
    cfg = config(tmp_path / "ep.yaml", "megatron", "tiny-qwen3-moe", checkpoint={"enabled": True})
    run = tmp_path / "ep2"
    train(cfg, run, "parallel.ep=2", "train.steps=2", nproc=2)
    assert yaml.safe_load((run / "config.yaml").read_text())["parallel"]["ep"] == 2
    exported = tmp_path / "out"
    primus("checkpoint", "export", str(run / "checkpoints"), "--to-hf", str(exported))
    ids = token_ids(seed=5)
    ours = engine_logits(run / "config.yaml", run / "checkpoints", ids, tmp_path)
    assert max_diff(hf_logits(exported, ids), ours) < 1e-5
