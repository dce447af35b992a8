"""LoRA is the same run on both engines: one ``train.lora`` recipe (rank-4 adapters on every projection of tiny-llama,
the default schedule: warmup, cosine decay, clipping, weight decay) trains the same loss curve on Megatron and
TorchTitan from the same frozen base (core's canonical init) and the same initial adapters (core's, PEFT's values),
and both export the same trained adapters to PEFT's format.

One rank each here; each engine's own test_lora.py holds its 2-rank layouts (megatron: DP with the distributed
optimizer, TP ± SP; TorchTitan: FSDP, DDP, TP) to its one-rank curve, so the engines' layouts equal each other too.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from hf_helpers import primus, run_config, train_logged
from safetensors.torch import load_file

pytest.importorskip("primus.megatron")
pytest.importorskip("primus.torchtitan")

STEPS = 6
LOSS_RTOL = 2e-5  # fp32 on CPU, reduction order only (test_same_run's)
ADAPTER_RTOL = 1e-4  # six Adam steps over the same gradients to that tolerance
ENGINES = ("megatron", "torchtitan")
LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_same_run")
    train_section = {
        "steps": STEPS,
        "grad_clip": 1.0,
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "weight_decay": 0.1},
        "schedule": {"warmup_steps": 2, "decay": "cosine"},
        "lora": LORA,
    }
    out = {}
    for engine in ENGINES:
        config = run_config(root / f"{engine}.yaml", engine, train=train_section, checkpoint={"interval": STEPS})
        rows, log = train_logged(config, root / engine)
        exported = root / f"adapter_{engine}"
        primus("checkpoint", "export", str(root / engine / "checkpoints"), "--to-hf", str(exported))
        out[engine] = {"rows": rows, "log": log, "adapter": exported}
    return out


def test_lora_trains_the_same_curve_on_both_engines(runs):
    mg, tt = (runs[e]["rows"] for e in ENGINES)
    assert [r["step"] for r in mg] == [r["step"] for r in tt] == list(range(1, STEPS + 1))
    for a, b in zip(mg, tt, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
    assert mg[-1]["loss"] < mg[0]["loss"]


def test_both_engines_say_what_trains(runs):
    # core's one line (primus.core.hf.lora.describe): tiny-llama's 2 layers x 7 projections at rank 4
    lines = {e: re.findall(r"LoRA: [^;]*; the base frozen in \w+", runs[e]["log"]) for e in ENGINES}
    assert (
        lines["megatron"]
        == lines["torchtitan"]
        == [
            "LoRA: 18,688 trainable parameters of 912,256 (2.05%): rank 4, alpha 8, q_proj, k_proj, v_proj, o_proj, "
            "gate_proj, up_proj, down_proj; the base frozen in fp32"
        ]
    )


def test_both_engines_export_the_same_adapters_to_peft(runs):
    configs = {e: json.loads((runs[e]["adapter"] / "adapter_config.json").read_text()) for e in ENGINES}
    assert configs["megatron"]["r"] == configs["torchtitan"]["r"] == LORA["rank"]
    assert configs["megatron"]["target_modules"] == configs["torchtitan"]["target_modules"]
    mg, tt = (load_file(runs[e]["adapter"] / "adapter_model.safetensors") for e in ENGINES)
    assert sorted(mg) == sorted(tt) and all(n.startswith("base_model.model.model.layers.") for n in mg)
    for name in mg:
        scale = tt[name].abs().max().item()
        assert scale > 0, name  # every adapter trained (B from zero, A from PEFT's draw)
        assert (mg[name] - tt[name]).abs().max().item() <= ADAPTER_RTOL * scale, name
