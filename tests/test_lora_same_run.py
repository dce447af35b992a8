"""LoRA is the same run on both engines: one ``train.lora`` recipe (rank-4 adapters on every projection of tiny-llama,
the default schedule: warmup, cosine decay, clipping, weight decay) trains the same loss curve on Megatron and
TorchTitan from the same frozen base (core's canonical init) and the same initial adapters (core's, PEFT's values),
and both export the same trained adapters to PEFT's format.

On a mixture-of-experts model (tiny-qwen3-moe) the same holds for its attention's adapters, on one rank and with
TorchTitan's expert parallelism on two.

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


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> dict:
    """tiny-qwen3-moe with the same recipe (every target named): its layers route their MLP to experts, so the
    adapters are the attention's, as PEFT's on transformers 5's fused experts. One rank on each engine, and TorchTitan
    with expert parallelism on 2."""
    import yaml

    root = tmp_path_factory.mktemp("lora_moe_same_run")
    train_section = {"steps": 4, "grad_clip": 1.0, "schedule": {"warmup_steps": 1, "decay": "cosine"}, "lora": LORA}
    out = {}
    for engine in ENGINES:
        config = run_config(root / f"{engine}.yaml", engine, train=train_section, checkpoint={"interval": 4})
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "extends": ["tiny-qwen3-moe"]}))
        rows, log = train_logged(config, root / engine)
        exported = root / f"adapter_{engine}"
        primus("checkpoint", "export", str(root / engine / "checkpoints"), "--to-hf", str(exported))
        out[engine] = {"rows": rows, "log": log, "adapter": exported}
    # TorchTitan's expert parallelism over FSDP's 2 ranks (frozen experts sharded, the adapters replicated)
    ep2 = ("parallel.dp_shard=2", "parallel.ep=2", "checkpoint.enabled=false")
    out["torchtitan_ep2"] = {"rows": train_logged(root / "torchtitan.yaml", root / "tt_ep2", *ep2, nproc=2)[0]}
    return out


def test_lora_on_a_moe_model_adapts_its_attention_the_same_on_both_engines(moe_runs):
    mg, tt, ep2 = (moe_runs[e]["rows"] for e in (*ENGINES, "torchtitan_ep2"))
    assert len(mg) == len(tt) == len(ep2) == 4
    for a, b in [*zip(mg, tt, strict=True), *zip(tt, ep2, strict=True)]:
        assert math.isclose(a["loss"], b["loss"], rel_tol=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
    lines = {e: re.findall(r"LoRA: [^;]*;", moe_runs[e]["log"]) for e in ENGINES}
    # tiny-qwen3-moe: 2 layers x q, k, v, o at rank 4 (hidden 128, 4 x 64 query and 2 x 64 key/value features)
    assert lines["megatron"] == lines["torchtitan"] and len(lines["megatron"]) == 1, lines
    assert lines["megatron"][0].startswith("LoRA: 10,240 trainable parameters of ")
    assert lines["megatron"][0].endswith("rank 4, alpha 8, q_proj, k_proj, v_proj, o_proj;"), lines
    configs = {e: json.loads((moe_runs[e]["adapter"] / "adapter_config.json").read_text()) for e in ENGINES}
    assert (
        configs["megatron"]["target_modules"]
        == configs["torchtitan"]["target_modules"]
        == [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
        ]
    )
    mg_t, tt_t = (load_file(moe_runs[e]["adapter"] / "adapter_model.safetensors") for e in ENGINES)
    assert sorted(mg_t) == sorted(tt_t) and len(mg_t) == 2 * 4 * 2 and not [n for n in mg_t if ".mlp." in n]
    for name in mg_t:
        assert (mg_t[name] - tt_t[name]).abs().max().item() <= ADAPTER_RTOL * max(tt_t[name].abs().max().item(), 1.0)
