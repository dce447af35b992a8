"""Fine-tuning from a Hugging Face model in one command, on both engines (train.objective: sft, the `sft` recipe):
chat records (rendered with the folder's chat template) and prompt / completion records, loss on the answers only.
The first step's loss equals ``transformers``' loss on the same tokens with the context labels set to -100, and
its gradient norm equals the norm of that masked loss's gradient (so context tokens contribute no gradient), for
``messages`` + prompt / completion .jsonl files, Alpaca records in a ``datasets`` save_to_disk folder and ShareGPT
records in a Parquet file; the exported checkpoint generates with ``transformers``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hf_helpers import make_hf, primus

# ChatML-like: the assistant header is context, the answer and its end marker are trained on
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
    for i in range(40)
]
PROMPTS = [{"prompt": f"Spell the number {i}:", "completion": f" the number {i} is spelled {i}"} for i in range(40)]
ALPACA = [
    {
        "instruction": f"Add {i} and {i}.",
        "input": f"Numbers: {i}, {i}" if i % 2 else "",
        "output": f"{i} + {i} = {2 * i}",
    }
    for i in range(40)
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "You count."},
            {"from": "human", "value": f"What comes after {i}?"},
            {"from": "gpt", "value": f"After {i} comes {i + 1}."},
        ]
    }
    for i in range(40)
]
STEPS = 2


def write_data(root, kind):
    """The overrides that train on ``kind``'s records: messages and prompt / completion .jsonl files, Alpaca records
    in a folder ``datasets`` saved (save_to_disk), ShareGPT records in a Parquet file."""
    if kind == "alpaca":
        import datasets

        datasets.Dataset.from_list(ALPACA).save_to_disk(str(root / "alpaca"))
        return [f"data.source={root / 'alpaca'}"]
    if kind == "sharegpt":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(SHAREGPT), root / "sharegpt.parquet")
        return [f"data.source={root / 'sharegpt.parquet'}"]
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return [f"data.source={root / 'chats.jsonl'}", f"data.paths=[{root / 'prompts.jsonl'}]"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from primus.core.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("sft")
    hf = make_hf(root / "hf", "llama", seed=3)
    load_tokenizer("bundled").save(str(hf / "tokenizer.json"))  # the model's tokenizer, with a chat template
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    base = [
        f"train.init_from={hf}",
        f"train.steps={STEPS}",
        "train.seq_len=48",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.precision=fp32",
        "train.grad_clip=0",
        "train.schedule.warmup_steps=0",
        "logging.interval=1",
        "logging.tensorboard=false",
        "logging.progress=false",
    ]
    return {"root": root, "hf": hf, "base": base, "overrides": base + write_data(root, "messages")}


@pytest.fixture(scope="module", params=["messages", "alpaca", "sharegpt"])
def trained(request, setup):
    """Two steps on each engine of the records of one kind (``write_data``): overrides and metrics rows."""
    root = setup["root"] / request.param
    root.mkdir()
    overrides = setup["base"] + write_data(root, request.param)
    runs = {}
    for backend in ("torchtitan", "megatron"):
        out = root / backend
        args = ["train", "sft", *overrides, f"backend.name={backend}", f"logging.output_dir={out}"]
        primus(*args, timeout=300)
        runs[backend] = (out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()])
    return {"kind": request.param, "overrides": overrides, "runs": runs}


def _first_batch(overrides):
    """The first global batch, as core hands it to both engines (inputs, labels with -100 for context)."""
    from primus.core.data import GlobalOrder
    from primus.core.data.splits import training_samples
    from primus.core.launch.resolve import resolve

    cfg = resolve("sft", overrides, world_size=1, check_plugins=False).config
    samples = training_samples(cfg)
    order = GlobalOrder(len(samples), cfg.train.seed)
    rows = [samples[order[k]] for k in range(cfg.train.global_batch_size)]
    return torch.from_numpy(np.stack([r[0] for r in rows])), torch.from_numpy(np.stack([r[1] for r in rows]))


def test_first_step_is_transformers_masked_loss_and_gradient(setup, trained):
    import transformers

    inputs, labels = _first_batch(trained["overrides"])
    masked = (labels == -100).float().mean().item()
    assert 0.2 < masked < 0.9  # both context and answers in the batch
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    logits = model(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    unmasked = torch.nn.functional.cross_entropy(logits.flatten(0, 1), inputs.roll(-1, 1).flatten()).item()
    assert abs(unmasked - loss.item()) > 1e-3  # the mask matters for this batch
    for backend, (_, rows) in trained["runs"].items():
        assert rows[0]["loss"] == pytest.approx(loss.item(), rel=1e-5), backend
        assert rows[0]["grad_norm"] == pytest.approx(norm, rel=1e-4), backend
    tt, mg = (trained["runs"][b][1] for b in ("torchtitan", "megatron"))
    assert [r["loss"] for r in tt] == pytest.approx([r["loss"] for r in mg], rel=1e-5)


def test_the_sft_recipe_takes_the_model_and_tokenizer_from_the_folder(setup):
    from primus.core.launch.resolve import resolve

    res = resolve("sft", setup["overrides"], world_size=1, check_plugins=False)
    assert res.config.data.tokenizer == str(setup["hf"]) and res.config.train.objective == "sft"
    assert res.layers.sources["data.tokenizer"] == f"config.json {setup['hf']}"


@pytest.mark.parametrize("trained", ["messages"], indirect=True)  # the records' kind does not reach the checkpoint
def test_export_generates_with_transformers(trained, tmp_path):
    import transformers

    out = trained["runs"]["torchtitan"][0]
    exported = tmp_path / "hf"
    primus("checkpoint", "export", str(out / "checkpoints"), "--to-hf", str(exported))
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    prompt = torch.tensor([[5, 6, 7, 8]])
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8) and torch.equal(generated[:, :4], prompt)
    shutil.rmtree(exported)


def test_bad_records_are_refused_before_the_run_folder(setup, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "run"
    proc = primus_fails("train", "sft", *setup["overrides"], f"data.source={bad}", f"logging.output_dir={out}")
    assert proc.returncode == 2 and "no assistant message to train on" in proc.stderr and not out.exists()


def primus_fails(*args):
    import subprocess
    import sys

    from hf_helpers import _env

    return subprocess.run(
        [sys.executable, "-m", "primus.core.cli.app", *args], capture_output=True, text=True, env=_env()
    )
