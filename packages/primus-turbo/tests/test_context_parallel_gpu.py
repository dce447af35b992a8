"""The fused block kernel of context-parallel attention on a GPU: torch's flash ops against the fp32 matmul blocks.

Both variants cut attention into full and square-causal blocks (``_ring_blocks`` / ``_gathered_blocks``); the CPU
tests check the ring and all-gather algorithms end to end with the matmul blocks. Here every block shape the plans
produce is checked with the flash blocks against the matmul ones (forward out and LSE; backward with a final out
and LSE given, as the ring's backward passes them), plus the whole-sequence impl against SDPA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from primus.turbo import context_parallel as cp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (flash kernels)")

B, HK, G, D = 2, 2, 3, 64  # GQA: 6 query heads on 2 K/V heads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("sq", "sk", "causal"),
    [(256, 256, True), (256, 256, False), (256, 128, False), (128, 256, False), (128, 384, False)],
)
def test_flash_blocks_match_math_blocks(sq, sk, causal, dtype):
    torch.manual_seed(0)
    q = cp._grouped(torch.randn(B, sq, HK * G, D, device="cuda", dtype=dtype), HK)  # the strides the ring uses
    kk, vv = torch.randn(2, B, sk, HK, D, device="cuda", dtype=dtype).permute(0, 1, 3, 2, 4)
    scale = D**-0.5
    assert cp._block_kernels(q, D) is cp._FlashBlocks

    out, lse = cp._FlashBlocks.forward(q, kk, vv, scale, causal)
    ref_out, ref_lse = cp._MathBlocks.forward(q, kk, vv, scale, causal)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)

    final = ref_out.to(dtype)  # stands for the merged output of all blocks
    dout = torch.randn_like(final)
    delta = (dout.float() * final.float()).sum(-1)
    grads = cp._FlashBlocks.backward(q, kk, vv, dout, final, ref_lse, delta, scale, causal)
    refs = cp._MathBlocks.backward(q, kk, vv, dout, final, ref_lse, delta, scale, causal)
    for got, want in zip(grads, refs, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_whole_sequence_impl_on_flash_matches_sdpa(causal):
    torch.manual_seed(0)
    b, h, hk, s, d = 2, 8, 2, 512, 128
    shapes = [(b, h, s, d), (b, hk, s, d), (b, hk, s, d)]
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for shape in shapes]
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

    out = cp.attention(*inputs, causal=causal)
    out.backward(grad)
    ref = F.scaled_dot_product_attention(*ref_inputs, is_causal=causal, enable_gqa=True)
    ref.backward(grad.float())

    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for x, r in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(x.grad.float(), r.grad, atol=5e-2, rtol=5e-2)
