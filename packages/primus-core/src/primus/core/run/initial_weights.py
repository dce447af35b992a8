"""The initial weights of a run: the same tensors from the same seed on every engine and every layout.

Each tensor is named by its Hugging Face name (:mod:`primus.core.hf.contract`, the names every backend already
maps to and from) and drawn in that canonical, unsharded layout; a backend converts it to its own layout (fused
QKV, permuted RoPE halves, ...) and keeps its shard, exactly as when it imports a Hugging Face folder. So a
tensor-parallel, pipelined or FSDP run starts from the weights of the single-device run, on either engine.

The scheme is Megatron-Core's: weights ~ N(0, init_std) (routers too); the output projections of each block
(``o_proj``, ``down_proj``, each expert's down projection) ~ N(0, init_std / sqrt(2 · num_layers)); norms 1; biases 0.

Rows are drawn in blocks of :data:`ROWS_PER_BLOCK`, each from a generator seeded by (seed, name, block), so a
rank can draw just the rows it holds (``rows=``) and no rank ever needs the whole model, or even a whole large
tensor: memory is one block plus the shard.
"""

from __future__ import annotations

import functools
import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from primus.core.hf.contract import shapes

if TYPE_CHECKING:
    import torch

    from primus.core.config.schema import ModelConfig

ROWS_PER_BLOCK = 64


def _seed(seed: int, name: str, block: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()[:8], "little") >> 1


def tensor(name: str, m: ModelConfig, seed: int, rows: slice | None = None) -> torch.Tensor:
    """The initial value of HF tensor ``name`` (fp32, CPU), or of its ``rows`` only (a slice of dim 0)."""
    import torch

    shape, kind = shapes(m)[name]
    start, stop, _ = (rows or slice(None)).indices(shape[0])
    part = (stop - start, *shape[1:])
    if kind in ("ones", "zeros"):
        return torch.ones(part) if kind == "ones" else torch.zeros(part)
    std = m.init_std / math.sqrt(2.0 * m.num_layers) if kind == "scaled" else m.init_std
    out = torch.empty(part)
    blocks = range(start // ROWS_PER_BLOCK, (stop + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK)

    def draw(chunk: range) -> None:
        gen = torch.Generator()
        for block in chunk:
            b0, b1 = block * ROWS_PER_BLOCK, min((block + 1) * ROWS_PER_BLOCK, shape[0])
            gen.manual_seed(_seed(seed, name, block))
            if start <= b0 and b1 <= stop:  # a whole block: drawn where it goes (no block-sized copy; same values)
                torch.randn((b1 - b0, *shape[1:]), generator=gen, out=out[b0 - start : b1 - start]).mul_(std)
                continue
            values = torch.randn((b1 - b0, *shape[1:]), generator=gen) * std
            lo, hi = max(b0, start), min(b1, stop)
            out[lo - start : hi - start] = values[lo - b0 : hi - b0]

    # CPU's randn runs on one thread (~200M values/s): a 1B model's start took 7 s drawing. Each block has its own
    # generator, so torch's intra-op threads' worth of Python threads (torch frees the GIL; torchrun sets 1 a rank)
    # draw the same values in any order.
    threads = min(torch.get_num_threads(), max(1, out.numel() // PARALLEL_MIN), len(blocks))
    if threads == 1:
        draw(blocks)
    else:
        list(_pool(torch.get_num_threads()).map(draw, (blocks[i::threads] for i in range(threads))))
    return out


PARALLEL_MIN = 1 << 17  # values a thread draws at least (~0.6 ms: more than handing it the work costs)


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool for the process (a MoE model draws thousands of expert tensors: threads are not started for each)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="primus-init")
