"""Packed fine-tuning (``data.sft_packing: packed``) trains what one chat per sample (``padded``) trains, on both
engines: several whole chats per sample, attention kept inside each chat by the chat ids the samples carry (the
template ends every turn with the tokenizer's EOS, so ids recomputed from EOS would split each chat at its turns),
the loss on the answers only.

Twelve chats (one longer than a sample: truncated) are one global batch either way, 12 padded samples or 6 packed
ones, so every step sees the same chats and the per-token loss over them is the same computation: the loss curve,
first-step gradient norm and a forward-only evaluation of packed equal padded, and the first step equals
``transformers``' masked loss over each chat alone (positions from 0), summed over the chats' trained tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_helpers import make_hf, primus

from primus.core.data.sft import IGNORE_INDEX

STEPS = 3
SEQ = 128
LOSS_RTOL = 1e-5  # fp32: the sums' order only
# ChatML with the tokenizer's EOS ending each turn (Qwen's template ends turns with <|im_end|>, its EOS)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat(i: int) -> dict:
    if i == 5:  # longer than SEQ + 1 tokens: truncated (its answer only in part)
        return {
            "messages": [
                {"role": "user", "content": "Count."},
                {"role": "assistant", "content": " ".join(map(str, range(60)))},
            ]
        }
    turns = [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]
    if i % 3 == 0:  # two answers in one chat
        turns += [{"role": "user", "content": "And twice that?"}, {"role": "assistant", "content": f"{4 * i}."}]
    return {"messages": turns}


CHATS = [_chat(i) for i in range(12)]
# the layouts: each a whole epoch of the chats per global batch
LAYOUTS = {
    "padded": ["data.sft_packing=padded", "train.micro_batch_size=4", "train.global_batch_size=12"],
    "packed": ["data.sft_packing=packed", "train.micro_batch_size=2", "train.global_batch_size=6"],
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from primus.core.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("sft_packing")
    hf = make_hf(root / "hf", "llama", seed=5)
    load_tokenizer("bundled").save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    base = [
        f"train.init_from={hf}",
        f"train.steps={STEPS}",
        f"train.seq_len={SEQ}",
        "train.precision=fp32",
        "train.grad_clip=0",
        "train.schedule.warmup_steps=0",
        "train.optimizer.lr=1e-3",
        "train.optimizer.min_lr=1e-3",
        f"data.source={data}",
        f"eval.source={data}",  # the same chats, forward only, after the last step
        f"eval.interval={STEPS}",
        "eval.batches=1",
        "checkpoint.enabled=false",
        "logging.interval=1",
        "logging.tensorboard=false",
        "logging.progress=false",
    ]
    return {"root": root, "hf": hf, "data": data, "base": base}


@pytest.fixture(scope="module")
def runs(setup):
    """Each engine, each layout: (metrics rows, what it printed)."""
    out = {}
    for backend in ("torchtitan", "megatron"):
        for layout, overrides in LAYOUTS.items():
            folder = setup["root"] / f"{backend}-{layout}"
            args = ["train", "sft", *setup["base"], *overrides, f"backend.name={backend}"]
            proc = primus(*args, f"logging.output_dir={folder}", timeout=300)
            rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
            out[backend, layout] = (rows, " ".join((proc.stdout + proc.stderr).split()))
    return out


def _samples(setup, layout):
    from primus.core.data.splits import training_samples
    from primus.core.launch.resolve import resolve

    overrides = [*setup["base"], *LAYOUTS[layout]]
    return training_samples(resolve("sft", overrides, world_size=1, check_plugins=False).config)


@pytest.fixture(scope="module")
def reference(setup):
    """``transformers``' masked loss over each chat alone (truncated to SEQ + 1 tokens), summed over the chats'
    trained tokens, and the norm of its gradient; and the loss of the packed samples without the chat mask."""
    import transformers

    from primus.core.data.sft import encode_records, renderer_for
    from primus.core.data.sources import source_inputs
    from primus.core.data.tokenizer import eos_id, load_tokenizer
    from primus.core.launch.resolve import resolve

    cfg = resolve("sft", setup["base"], world_size=1, check_plugins=False).config
    tok = load_tokenizer(str(setup["hf"]))
    tokens, trainable, lengths = encode_records(
        source_inputs(cfg.data), tok, eos_id(tok), renderer_for(str(setup["hf"]), tok)
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    total, count, truncated = 0.0, 0, 0
    for start, n in zip(np.cumsum(lengths) - lengths, lengths, strict=True):
        keep = min(int(n), SEQ + 1)
        truncated += keep < n
        chat = torch.from_numpy(tokens[start : start + keep])
        labels = torch.where(torch.from_numpy(trainable[start + 1 : start + keep]), chat[1:], IGNORE_INDEX)
        logits = model(chat[None, :-1]).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels != IGNORE_INDEX).sum())
    loss = total / count
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    with torch.no_grad():  # the packed samples with causal attention across their chats
        packed = _samples(setup, "packed")
        rows = [packed[i] for i in range(len(packed))]
        inputs, labels = (torch.from_numpy(np.stack([r[k] for r in rows])) for k in (0, 1))
        unmasked = torch.nn.functional.cross_entropy(model(inputs).logits.flatten(0, 1), labels.flatten()).item()
    return {"loss": loss.item(), "grad_norm": norm, "truncated": truncated, "unmasked": unmasked}


def _losses(rows, key="loss"):
    return [r[key] for r in rows if key in r]


def test_the_chats_are_packed_as_the_test_means(setup, reference):
    padded, packed = _samples(setup, "padded"), _samples(setup, "packed")
    assert len(padded) == 12 and len(packed) == 6 and reference["truncated"] == 1
    assert any(len(b) > 1 for b in packed.bins) and sorted(c for b in packed.bins for c in b) == list(range(12))
    assert abs(reference["unmasked"] - reference["loss"]) > 1e-3  # the chat mask matters for these samples


def test_packed_trains_the_padded_curve_and_transformers_loss_on_both_engines(runs, reference):
    for backend in ("torchtitan", "megatron"):
        padded, packed = (runs[backend, layout][0] for layout in LAYOUTS)
        assert _losses(padded)[0] == pytest.approx(reference["loss"], rel=LOSS_RTOL), backend
        assert _losses(padded)[-1] < _losses(padded)[0] - 0.1  # it trained
        assert _losses(packed) == pytest.approx(_losses(padded), rel=LOSS_RTOL), backend
        for rows in (padded, packed):
            assert rows[0]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), backend
        assert _losses(packed, "eval_loss") == pytest.approx(_losses(padded, "eval_loss"), rel=LOSS_RTOL), backend
        assert len(_losses(packed, "eval_loss")) == 1
    tt, mg = (_losses(runs[b, "packed"][0]) for b in ("torchtitan", "megatron"))
    assert tt == pytest.approx(mg, rel=LOSS_RTOL)


def test_the_runs_say_how_the_chats_were_laid_out(runs):
    text = runs["megatron", "packed"][1]
    assert "data.sft_packing packed: 12 chats in 6 samples of 128 positions" in text
    assert "data.sft_packing packed: 1 of 12 chats are longer than train.seq_len + 1 (129) tokens: truncated" in text
