"""Model families (Qwen3 qk-norm under TP + SP, Qwen2.5 qkv bias + tied embeddings under PP), bf16,
and Megatron indexed data (.bin/.idx through megatron-core's GPTDataset)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from megatron_helpers import CONFIGS, LOSS_TOL, TINY, losses, train

FAMILY_LAYOUTS = {
    # qk-norm weights are replicated over TP but see different heads: megatron must all-reduce them
    "qwen3": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    # tied embeddings across pipeline stages: the embedding and the head live on different ranks
    "qwen2": ["parallel.pp=2"],
}


@pytest.mark.parametrize("family", list(FAMILY_LAYOUTS))
def test_family_trains_and_layout_matches(tmp_path, family):
    config = str(CONFIGS / f"{family}.yaml")
    ref = losses(train(config, tmp_path / "ws1", 1, f"train.save_initial={tmp_path / 'seed'}"))
    seed = f"train.init_from={tmp_path / 'seed'}"
    assert ref[-1] < ref[0] - 0.3, ref
    other = losses(train(config, tmp_path / "layout", 2, seed, *FAMILY_LAYOUTS[family]))
    assert other == pytest.approx(ref, abs=LOSS_TOL)


def test_bf16_trains_close_to_fp32(reference, bf16_run):
    # bf16 compute, fp32 master weights, from the same canonical weights: the same curve to within bf16 rounding
    assert losses(bf16_run) == pytest.approx(reference["losses"], abs=0.05)
    assert losses(bf16_run) != reference["losses"]


def _write_indexed(prefix: Path) -> None:
    """The bundled corpus as a Megatron .bin/.idx pair, written by megatron-core's own builder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from primus.core.config.schema import DataConfig
    from primus.core.data import eos_id, load_token_stream, load_tokenizer

    tok = load_tokenizer("bundled")
    tokens = load_token_stream(DataConfig(source="bundled"), tok, 2048, 1234)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    start = 0
    for end in np.flatnonzero(tokens == eos_id(tok)) + 1:
        if end - start > 1:
            builder.add_document(torch.from_numpy(tokens[start:end].astype(np.int64)), [int(end - start)])
        start = end
    builder.finalize(f"{prefix}.idx")


def test_megatron_indexed_data(tmp_path):
    _write_indexed(tmp_path / "corpus")
    rows = train(
        TINY,
        tmp_path / "run",
        2,
        "data.format=megatron",
        f"data.source={tmp_path / 'corpus'}",
        "parallel.dp_replicate=2",
        "parallel.dp_shard=1",
    )
    assert losses(rows)[-1] < losses(rows)[0] - 0.3, losses(rows)
    assert any((tmp_path / "run" / "megatron_data_cache").glob("*GPTDataset-train-sample_index.npy"))
