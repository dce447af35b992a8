"""Shape recording from real model steps on CPU: every linear shows its three GEMMs with the right sizes."""

from __future__ import annotations

import torch
from torch import nn

from primus.core.config.schema import ModelConfig
from primus.tune.model import step_gemms
from primus.tune.record import GemmRecorder, load_shapes, save_shapes
from primus.tune.shapes import GemmShape, linear_gemms


def _keys(rec: GemmRecorder) -> dict[str, int]:
    return {r.shape.key: r.count for r in rec.records}


def test_a_torch_transformer_layer_shows_all_three_gemms_of_each_linear():
    torch.manual_seed(0)
    d, ff, b, s = 32, 80, 2, 12
    layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=ff, dropout=0.0, batch_first=True)
    x = torch.randn(b, s, d, requires_grad=True)
    with GemmRecorder() as rec:
        layer(x).square().mean().backward()

    t = b * s
    seen = _keys(rec)
    # out_proj, linear1, linear2: forward is addmm x·Wᵀ + b (NT). in_proj (packed q/k/v) gets a transposed
    # (batch_first) input, so F.linear runs it as mm + a separate bias add.
    for n_in, n_out, op in ((d, 3 * d, "mm"), (d, d, "addmm"), (d, ff, "addmm"), (ff, d, "addmm")):
        fwd, dgrad, wgrad = linear_gemms(t, n_in, n_out, dtype="float32")
        fwd = GemmShape(op, fwd.m, fwd.n, fwd.k, layout="NT", dtype="float32", out_dtype="float32", bias=op == "addmm")
        assert seen.get(fwd.key, 0) >= 1, fwd.key
        assert seen.get(dgrad.key, 0) >= 1, dgrad.key
        assert seen.get(wgrad.key, 0) >= 1, wgrad.key
    phases = {r.shape.key: r.phases for r in rec.records}
    assert phases[GemmShape("mm", t, d, ff, layout="NN", dtype="float32", out_dtype="float32").key] == {"backward"}
    assert all(r.shape.op in ("mm", "addmm") for r in rec.records)  # attention ran in SDPA, not in BLAS
    # 4 linears × 3 GEMMs; the x gradient of in_proj is one GEMM (q, k, v share the input)
    assert sum(r.count for r in rec.records) == 12


def test_reference_decoder_step_on_cpu_and_meta_agree_and_cover_every_linear():
    m = ModelConfig()  # tiny-llama: d 128, 2 layers, 4 heads × 32, 2 kv heads, ffn 352, vocab 2048
    cpu = step_gemms(m, micro_batch=2, seq_len=32, device="cpu")
    meta = step_gemms(m, micro_batch=2, seq_len=32, device="meta")
    assert [r.to_dict() for r in cpu.records] == [r.to_dict() for r in meta.records]

    t, d, kv, ffn, vocab = 64, 128, 2 * 32, 352, 2048
    expected: dict[str, int] = {}
    linears = [(d, d), (d, kv), (d, kv), (d, d), (d, ffn), (d, ffn), (ffn, d)] * m.num_layers + [(d, vocab)]
    for n_in, n_out in linears:
        for g in linear_gemms(t, n_in, n_out):
            expected[g.key] = expected.get(g.key, 0) + 1
    assert _keys(cpu) == expected
    assert {r.shape.dtype for r in cpu.records} == {"bfloat16"}


def test_megatron_layout_fuses_qkv_and_gate_up_and_tp_splits():
    m = ModelConfig()
    fused = _keys(step_gemms(m, micro_batch=1, seq_len=16, device="meta", fused=True))
    assert GemmShape("mm", 16, 128 + 2 * 64, 128, layout="NT").key in fused  # one qkv GEMM
    assert GemmShape("mm", 16, 2 * 352, 128, layout="NT").key in fused  # one gate+up GEMM
    tp2 = _keys(step_gemms(m, micro_batch=1, seq_len=16, device="meta", tp=2))
    assert GemmShape("mm", 16, 176, 128, layout="NT").key in tp2  # column-parallel: out / tp
    assert GemmShape("mm", 16, 128, 176, layout="NT").key in tp2  # row-parallel (down): in / tp
    assert GemmShape("mm", 16, 1024, 128, layout="NT").key in tp2  # vocab-parallel head


def test_batched_and_scaled_gemms_are_recorded():
    with GemmRecorder() as rec:
        x, y = torch.randn(3, 8, 16), torch.randn(3, 16, 4)
        torch.bmm(x, y)
        torch.baddbmm(torch.randn(3, 8, 4), x, y)
        torch.bmm(x, torch.randn(3, 4, 16).transpose(1, 2))
        a = torch.randn(32, 64).to(torch.float8_e4m3fn)
        b = torch.randn(48, 64).to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0)
        torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    keys = _keys(rec)
    assert keys == {
        "bmm NN float32 m8 n4 k16 batch3": 1,
        "baddbmm NN float32 m8 n4 k16 batch3 bias": 1,
        "bmm NT float32 m8 n4 k16 batch3": 1,
        "scaled_mm NT float8_e4m3fn out:bfloat16 m32 n48 k64": 1,
    }


def test_shapes_file_round_trip(tmp_path):
    rec = step_gemms(ModelConfig(), micro_batch=1, seq_len=16, device="meta")
    path = save_shapes(tmp_path / "s.json", rec.records, {"model": "tiny-llama"})
    records, source = load_shapes(path)
    assert source == {"model": "tiny-llama"}
    assert [r.to_dict() for r in records] == [r.to_dict() for r in rec.records]


def test_blas_view_swaps_operands():
    fwd = linear_gemms(8192, 2048, 512)[0]  # x·Wᵀ: NT, m tokens
    assert fwd.blas() == {"transa": "T", "transb": "N", "m": 512, "n": 8192, "k": 2048, "batch": 1}
