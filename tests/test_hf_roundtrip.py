"""HF -> engine -> HF, on both engines, one process: a random tiny ``transformers`` model is imported (as
``primus checkpoint import`` does), the engine's own forward pass on the imported checkpoint must give HF's
logits, and the exported folder must hold the same tensors and load in ``transformers`` with equal logits.

Measured (fp32, CPU): megatron's logits equal HF's exactly (0.0); torchtitan's differ by <= 6e-7 for llama3
(its complex-pair RoPE is another rounding of the same rotation), 0.0 for qwen3. The exports are bit-equal.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import hf_logits, make_hf, max_diff, roundtrip, run_config, token_ids
from safetensors.torch import load_file

ENGINE_TOL = 1e-5  # an engine's forward vs transformers, fp32 (measured <= 6e-7)

CASES = {
    "llama-rope-scaling": ("llama", {"llama3_rope": True}),  # Llama 3.1 style RoPE scaling
    "qwen2-tied": ("qwen2", {"tied": True}),  # Qwen2.5: qkv bias; small ones tie the head
    "qwen3": ("qwen3", {}),  # qk-norm, head_dim != hidden / heads
    "qwen3-moe": ("qwen3", {"moe": True}),  # 8 experts, top 2, one tensor per expert in the HF folder
    "mixtral": ("mistral", {"moe": True}),
}
# torchtitan 0.2.2 builds experts only in its qwen3 model (Mixtral is refused by its validate)
PAIRS = [(b, c) for c in CASES for b in ("megatron", "torchtitan") if not (b == "torchtitan" and c == "mixtral")]


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.mark.parametrize(("backend", "case"), PAIRS)
def test_import_forward_export(tmp_path, backend, case):
    family, opts = CASES[case]
    hf = make_hf(tmp_path / "hf", family, **opts)
    ids = token_ids()
    ref = hf_logits(hf, ids)
    # torchtitan's MoE has no auxiliary loss (and only a qwen3 model to hold it): the run's config says how it
    # balances, which the HF folder does not
    model = None
    if backend == "torchtitan" and opts.get("moe"):
        model = {"family": "qwen3", "qk_norm": True, "moe": {"balancing": "loss_free"}}
    logits, exported = roundtrip(run_config(tmp_path / "run.yaml", backend, model), hf, tmp_path, ids)
    assert max_diff(logits, ref) < ENGINE_TOL

    original, written = hf_tensors(hf), hf_tensors(exported)
    assert sorted(written) == sorted(original)
    for name, t in original.items():
        assert torch.equal(written[name], t), name
    # the import is a weights-only checkpoint, marked as train.save_initial's are (core's weights_only record)
    manifest = next((tmp_path / "engine_ckpt").rglob("manifest.json"))
    assert json.loads(manifest.read_text())["weights_only"]["init_from"] == str(hf)
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert (exported / "tokenizer.json").is_file()  # the run's (bundled) tokenizer goes along
    assert max_diff(hf_logits(exported, ids), ref) == 0.0
