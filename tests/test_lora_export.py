"""LoRA end to end on a real engine (TorchTitan, CPU, fp32): a Hugging Face folder -> ``primus train`` with
``train.lora`` (3 steps) -> ``primus checkpoint export`` -> ``peft.PeftModel.from_pretrained`` on the same folder gives
the engine's logits (its model with the base from the folder and the trained adapters on its own layout); ``--merge``
gives a folder ``transformers`` loads with those logits; a run continues from the exported adapters
(``train.lora.init_from``) on the same base."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from hf_helpers import hf_logits, make_hf, max_diff, primus, run, run_config, token_ids, train

pytest.importorskip("primus.torchtitan")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
if not hasattr(pytest.importorskip("primus.torchtitan.hf").INTEROP, "export_adapters"):
    pytest.skip("the torchtitan backend does not export LoRA adapters", allow_module_level=True)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 4, "alpha": 8.0, "target_modules": TARGETS}
TOL = 1e-5

# the engine's model of a LoRA run: built as the engine builds it (the adapters on its own layout), the base from the
# Hugging Face folder, the adapters the checkpoint's (in a child process: the engine patches torch for the CPU)
_ENGINE_LOGITS = """
import sys, torch
from pathlib import Path
from primus.core.hf.contract import OFFLINE_OVERRIDES
from primus.core.hf.safetensors_io import HFReader
from primus.core.launch.resolve import resolve
from primus.torchtitan import lora
from primus.torchtitan.hf import INTEROP, build_model, fill_from_hf

config, checkpoint, base, ids_path, out_path = sys.argv[1:6]
cfg = resolve(config, [*OFFLINE_OVERRIDES, "train.lora.init_from=null"], world_size=1).config
model = build_model(cfg)
found = lora.targets(cfg)
lora.attach(model, cfg, found)
fill_from_hf([model], cfg, HFReader(base).get)
adapters = INTEROP.export_adapters(cfg, Path(checkpoint))
with torch.no_grad():
    for t in found:
        module = model.get_submodule(t.path + lora.SUFFIX)
        module.lora_A.copy_(adapters[t.adapter.name("lora_A")])
        module.lora_B.copy_(adapters[t.adapter.name("lora_B")])
    torch.save(model.eval()(torch.load(ids_path)), out_path)
"""


def engine_logits(config, checkpoint, base, ids, tmp) -> torch.Tensor:
    torch.save(ids, tmp / "ids.pt")
    run(
        [
            sys.executable,
            "-c",
            _ENGINE_LOGITS,
            str(config),
            str(checkpoint),
            str(base),
            str(tmp / "ids.pt"),
            str(tmp / "l.pt"),
        ]
    )
    return torch.load(tmp / "l.pt")


def peft_logits(base, adapter, ids) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(ids).logits


def test_lora_run_exports_to_peft_and_merged(tmp_path):
    base = make_hf(tmp_path / "base", "llama")
    config = run_config(
        tmp_path / "lora.yaml",
        "torchtitan",
        train={"steps": 3, "init_from": str(base), "lora": LORA},
        checkpoint={"enabled": True, "interval": 3},
    )
    out = tmp_path / "run"
    rows = train(config, out)
    assert len(rows) == 3
    ckpt = out / "checkpoints"
    ids = token_ids()

    primus("checkpoint", "export", str(ckpt), "--to-hf", str(tmp_path / "adapter"))
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["base_model_name_or_path"]) == (4, 8, str(base))
    mine = engine_logits(out / "config.yaml", ckpt, base, ids, tmp_path)
    theirs = peft_logits(base, tmp_path / "adapter", ids)
    assert max_diff(mine, theirs) < TOL
    assert max_diff(theirs, hf_logits(base, ids)) > 1e-3  # three steps moved the adapters

    primus("checkpoint", "export", str(ckpt), "--to-hf", str(tmp_path / "merged"), "--merge")
    assert max_diff(hf_logits(tmp_path / "merged", ids), theirs) < TOL

    # the base stays in the folder it came from: the checkpoint holds the adapters (and their optimizer state)
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    weights = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    assert size < weights / 2

    # continue from the exported adapters on the same base: the first step starts where the last one left off
    more = tmp_path / "more"
    rows2 = train(config, more, f"train.lora.init_from={tmp_path / 'adapter'}", "train.steps=1")
    assert rows2[0]["loss"] < rows[0]["loss"]
