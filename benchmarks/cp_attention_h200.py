"""primus-turbo's context-parallel attention against PyTorch's cuDNN SDPA on one GPU: fwd + bwd time and error.

Shapes: batch 1, 32 query heads, 8 K/V heads (GQA), head_dim 128, bf16, causal, seq 8192 and 32768 (``--seqs``).

Cases (all get the same bf16 inputs, ``[b, h, s, d]`` contiguous, and the same output gradient):

``turbo_attention_cp1``
    ``primus.turbo.context_parallel.attention(q, k, v, causal=True)``: the ``ring`` provider's whole-sequence impl
    (cp = 1; one square-causal block through the module's block kernel, fp32 output / dq / dkv accumulators).
``turbo_ring_ws1`` / ``turbo_allgather_ws1``
    ``context_parallel_attention`` over a real world-size-1 gloo group (no communication at cp = 1); the
    all-gather variant cuts even cp = 1 into 3 blocks (causal, full, causal) merged by LSE.
``emulated_{ring,allgather}_cp{2,4}``
    cp > 1 on one device, no process group: the module's own block plan (``_ring_blocks`` /
    ``_gathered_blocks``), block kernel (``_block_kernels``), ``_forward_blocks`` / ``_backward_blocks`` (LSE merge,
    fp32 accumulators) run for every rank of megatron's load-balanced split (``shard_for_cp``) one after the
    other; each ring hop / all-gather / reduce-scatter is replaced by reading or adding into the other ranks'
    tensors on the same device. The time is the sum of all ranks' work (per-rank times also recorded), i.e. the
    block decomposition's cost against one fused kernel, with communication left out.
``sdpa_cudnn`` (and ``sdpa_flash`` for context: the backend whose kernels the module's ``_FlashBlocks`` call)
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` under ``sdpa_kernel``; if the
    backend refuses ``enable_gqa``, K/V are ``repeat_interleave``d inside the timed region (recorded).

Error: every case's output and dq / dk / dv against an fp32 reference (explicit matmuls, no TF32, one query head
at a time, from the same bf16 inputs): max abs error, max abs error / max |ref|, and ||x - ref|| / ||ref||; the
error of rounding the reference itself to bf16 is recorded as the floor.

Run (one H200): ``PYTHONPATH=packages/primus-turbo/src python3 benchmarks/cp_attention_h200.py --out X.json``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from primus.turbo import context_parallel as tcp

sys.path.insert(0, os.path.dirname(__file__))
from _common import clear_grads as _clear  # noqa: E402
from _common import time_autograd  # noqa: E402

B, HQ, HKV, D = 1, 32, 8, 128
DTYPE = torch.bfloat16


# --- cp > 1 emulated on one device with the module's own block functions ------------------------------------------


def emulate_cp(q, k, v, dout, cp: int, variant: str, scale: float, events: bool = False):
    """Every rank's forward then every rank's backward of ``_ContextParallelAttention`` for cp ranks on one device,
    communication replaced by indexing. Inputs ``[b, S, h, d]`` (whole sequence); returns the unsharded
    ``(out, dq, dk, dv)`` and, with ``events``, per-rank ``(fwd, bwd)`` event pairs."""
    causal = True
    qs = [tcp.shard_for_cp(q, cp, r) for r in range(cp)]
    ks = [tcp.shard_for_cp(k, cp, r) for r in range(cp)]
    vs = [tcp.shard_for_cp(v, cp, r) for r in range(cp)]
    ds = [tcp.shard_for_cp(dout, cp, r) for r in range(cp)]
    parts, ev = _emulate_sharded(qs, ks, vs, ds, cp, variant, scale, causal, events)
    return [tcp.unshard_from_cp(x, cp) for x in parts], ev


def _gathered(kvs: list[torch.Tensor], cp: int) -> torch.Tensor:
    """What ``_gather_kv`` builds from the all-gathered ``[cp·2, b, s_local, hk, d]`` buffer (the gather itself is
    the stack)."""
    parts = torch.cat(kvs, dim=0).view(cp, *kvs[0].shape)
    halves: list[Any] = [None] * (2 * cp)
    for rank in range(cp):
        first, second = tcp.cp_chunks(cp, rank)
        halves[first], halves[second] = parts[rank].chunk(2, dim=2)
    return torch.cat(halves, dim=2).permute(0, 1, 3, 2, 4)


def _emulate_sharded(qs, ks, vs, ds, cp, variant, scale, causal, events):
    acc = torch.float32
    hk, half, d = ks[0].shape[2], qs[0].shape[1] // 2, qs[0].shape[-1]
    kernel = tcp._block_kernels(qs[0], d)
    ev = []
    # forward, rank by rank
    saved = []
    kvs = [torch.stack((ks[i], vs[i])) for i in range(cp)]  # each rank stacks its own K/V once; the others arrive
    for r in range(cp):
        pair = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if events else None
        if pair:
            pair[0].record()
        q = qs[r]
        qg = tcp._grouped(q, hk)
        out = q.new_zeros(qg.shape, dtype=acc)
        lse = q.new_full(qg.shape[:-1], float("-inf"), dtype=torch.float32)
        if variant == "allgather":
            kk, vv = _gathered(kvs, cp) if cp > 1 else kvs[0].permute(0, 1, 3, 2, 4)
            tcp._forward_blocks(kernel, tcp._gathered_blocks(r, cp, causal, half), qg, kk, vv, out, lse, scale)
        else:
            for step in range(cp):
                src = (r - step) % cp
                kk, vv = kvs[src].permute(0, 1, 3, 2, 4)
                tcp._forward_blocks(kernel, tcp._ring_blocks(r, src, causal, half), qg, kk, vv, out, lse, scale)
        saved.append((tcp._ungrouped(out).to(q.dtype), lse))
        if pair:
            pair[1].record()
        ev.append(pair)
    # backward, rank by rank; dK/dV of rank src's K/V accumulate in owner[src] (the ring's travelling accumulator
    # / the reduce-scatter's sum)
    owner = [torch.zeros((2, B, hk, qs[0].shape[1], d), dtype=acc, device=qs[0].device) for _ in range(cp)]
    dqs = []
    kvs = [torch.stack((ks[i], vs[i])) for i in range(cp)]
    for r in range(cp):
        pair = ev[r]
        if pair:
            pair[2].record()
        q, result, lse = qs[r], saved[r][0], saved[r][1]
        qg, dout, result_g = tcp._grouped(q, hk), tcp._grouped(ds[r].to(q.dtype), hk), tcp._grouped(result, hk)
        delta = (dout.to(acc) * result_g.to(acc)).sum(-1)
        dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
        rest = (dout, result_g, lse, delta, dq)
        if variant == "allgather":
            kk, vv = _gathered(kvs, cp) if cp > 1 else kvs[0].permute(0, 1, 3, 2, 4)
            dkv = torch.zeros((2, *kk.shape), dtype=acc, device=q.device)
            tcp._backward_blocks(kernel, tcp._gathered_blocks(r, cp, causal, half), qg, kk, vv, *rest, dkv, scale)
            chunks = dkv.chunk(2 * cp, dim=3)
            per_rank = torch.stack([torch.cat([chunks[c] for c in tcp.cp_chunks(cp, i)], dim=3) for i in range(cp)])
            for i in range(cp):  # the reduce-scatter's sum
                owner[i] += per_rank[i]
        else:
            for step in range(cp):
                src = (r - step) % cp
                kk, vv = kvs[src].permute(0, 1, 3, 2, 4)
                part = torch.zeros((2, B, hk, q.shape[1], d), dtype=acc, device=q.device)
                tcp._backward_blocks(kernel, tcp._ring_blocks(r, src, causal, half), qg, kk, vv, *rest, part, scale)
                owner[src] += part  # `part += arrived` in the ring
        dqs.append(tcp._ungrouped(dq).to(q.dtype))
        if pair:
            pair[3].record()
    dks, dvs = [], []
    for r in range(cp):
        dk, dv = (x.permute(0, 2, 1, 3).to(DTYPE) for x in owner[r])
        dks.append(dk)
        dvs.append(dv)
    outs = [s[0] for s in saved]
    return (outs, dqs, dks, dvs), ev  # each a list of the ranks' shards


def time_emulated(q, k, v, dout, cp, variant, scale, warmup, iters) -> dict[str, Any]:
    """Median of the whole emulated fwd+bwd (all ranks), shards made outside the timed region."""
    qs = [tcp.shard_for_cp(q, cp, r) for r in range(cp)]
    ks = [tcp.shard_for_cp(k, cp, r) for r in range(cp)]
    vs = [tcp.shard_for_cp(v, cp, r) for r in range(cp)]
    ds = [tcp.shard_for_cp(dout, cp, r) for r in range(cp)]
    for _ in range(warmup):
        _emulate_sharded(qs, ks, vs, ds, cp, variant, scale, True, False)
    torch.cuda.synchronize()
    total, fwd_sum, per_rank = [], [], []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        _, ev = _emulate_sharded(qs, ks, vs, ds, cp, variant, scale, True, True)
        e1.record()
        torch.cuda.synchronize()
        total.append(e0.elapsed_time(e1))
        ranks = [(p[0].elapsed_time(p[1]), p[2].elapsed_time(p[3])) for p in ev]
        fwd_sum.append(sum(f for f, _ in ranks))
        per_rank.append([f + b for f, b in ranks])
    med_rank = [statistics.median(it[r] for it in per_rank) for r in range(cp)]
    return {
        "fwd_bwd_ms": statistics.median(total),  # all ranks' work, summed
        "fwd_ms": statistics.median(fwd_sum),
        "bwd_ms": statistics.median(t - f for t, f in zip(total, fwd_sum, strict=True)),
        "per_rank_fwd_bwd_ms": [round(x, 3) for x in med_rank],
        "max_rank_fwd_bwd_ms": max(med_rank),
        "fwd_bwd_ms_all": [round(x, 3) for x in total],
    }


# --- fp32 reference --------------------------------------------------------------------------------------------


def reference(q, k, v, dout, scale):
    """fp32 out, dq, dk, dv in ``[b, h, s, d]``: explicit matmuls, one query head at a time (no TF32)."""
    s, g = q.shape[2], q.shape[1] // k.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dq = torch.empty_like(out)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            kh_i = h // g
            qh, kh, vh, doh = q[b, h].float(), k[b, kh_i].float(), v[b, kh_i].float(), dout[b, h].float()
            p = torch.matmul(qh, kh.t()).mul_(scale).masked_fill_(mask, float("-inf"))
            lse = torch.logsumexp(p, dim=-1, keepdim=True)
            p.sub_(lse).exp_()
            o = torch.matmul(p, vh)
            out[b, h] = o
            dv[b, kh_i] += torch.matmul(p.t(), doh)
            dp = torch.matmul(doh, vh.t())
            delta = (doh * o).sum(-1, keepdim=True)
            dp.sub_(delta).mul_(p)  # dS
            del p
            dq[b, h] = torch.matmul(dp, kh).mul_(scale)
            dk[b, kh_i] += torch.matmul(dp.t(), qh).mul_(scale)
            del dp
    del mask
    return out, dq, dk, dv


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = got.float() - ref
    return {
        "max_abs": diff.abs().max().item(),
        "max_abs_over_max_ref": (diff.abs().max() / ref.abs().max()).item(),
        "rel_fro": (diff.norm() / ref.norm()).item(),
    }


def all_errors(results, refs) -> dict[str, Any]:
    return {name: errors(x, r) for name, x, r in zip(("out", "dq", "dk", "dv"), results, refs, strict=True)}


# --- cases ---------------------------------------------------------------------------------------------------------


def sdpa_fn(backend, gqa: bool):
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v):
        with sdpa_kernel(backend):
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            g = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), is_causal=True
            )

    return fn


def grads_of(fn, inputs, dout):
    _clear(inputs)
    out = fn(*inputs)
    out.backward(dout)
    torch.cuda.synchronize()
    res = [out.detach(), *(x.grad.detach() for x in inputs)]
    _clear(inputs)
    return res


def kernel_names(fn, inputs, dout, top: int = 8) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    _clear(inputs)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*inputs).backward(dout)
        torch.cuda.synchronize()
    _clear(inputs)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if t:
            rows.append({"name": e.key[:140], "us": round(t, 1), "calls": e.count})
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def run_seq(seq: int, args, group, record) -> None:
    torch.manual_seed(seq)
    dev = "cuda"
    scale = D**-0.5
    q = torch.randn(B, HQ, seq, D, device=dev, dtype=DTYPE, requires_grad=True)
    k = torch.randn(B, HKV, seq, D, device=dev, dtype=DTYPE, requires_grad=True)
    v = torch.randn(B, HKV, seq, D, device=dev, dtype=DTYPE, requires_grad=True)
    dout = torch.randn(B, HQ, seq, D, device=dev, dtype=DTYPE)
    inputs = [q, k, v]
    res: dict[str, Any] = {"shape": {"b": B, "s": seq, "hq": HQ, "hkv": HKV, "d": D, "dtype": "bf16", "causal": True}}
    record[str(seq)] = res
    # causal fwd+bwd FLOPs (fwd 2 matmuls, bwd 5 incl. the recomputed scores), half the square
    flops = 4 * B * HQ * seq * seq * D / 2 * (1 + 2.5)
    res["flops_fwd_bwd"] = flops

    t0 = time.time()
    refs = reference(q.detach(), k.detach(), v.detach(), dout, scale)
    torch.cuda.synchronize()
    res["reference"] = {
        "kind": "fp32 explicit matmuls (TF32 off), one query head at a time, same bf16 inputs",
        "seconds": round(time.time() - t0, 2),
        "bf16_rounding_floor": all_errors([r.to(DTYPE) for r in refs], refs),
    }
    print(f"[{seq}] reference done in {res['reference']['seconds']} s", flush=True)

    kpath = tcp._block_kernels(q.transpose(1, 2), D)
    res["turbo_block_kernels"] = kpath.__name__

    cases: dict[str, Any] = {}
    res["cases"] = cases

    def case(name, fn, note=None, profile_it=False, inputs=inputs, dout=dout, refs=refs):  # bound at definition
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            got = grads_of(fn, inputs, dout)
            entry: dict[str, Any] = {"errors_vs_fp32_ref": all_errors(got, refs)}
            if "sdpa_cudnn" in cases and "outputs" in cases["sdpa_cudnn"]:
                entry["errors_vs_cudnn"] = all_errors(got, cases["sdpa_cudnn"]["outputs"])
            entry.update(time_autograd(fn, inputs, dout, args.warmup, args.iters))
            entry["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
            entry["tflops"] = round(flops / (entry["fwd_bwd_ms"] * 1e-3) / 1e12, 1)
            if note:
                entry["note"] = note
            if profile_it and args.profile:
                try:
                    entry["top_kernels"] = kernel_names(fn, inputs, dout)
                except Exception as exc:
                    entry["top_kernels"] = f"profiler failed: {type(exc).__name__}: {exc}"[:500]
            if name == "sdpa_cudnn":
                entry["outputs"] = [x.float() for x in got]
            del got
        except Exception as exc:  # record and go on
            entry = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}
        cases[name] = entry
        print(
            f"[{seq}] {name}: " + json.dumps({k: entry.get(k) for k in ("fwd_bwd_ms", "fwd_ms", "error")}), flush=True
        )

    from torch.nn.attention import SDPBackend

    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn"), (SDPBackend.FLASH_ATTENTION, "sdpa_flash")):
        fn = sdpa_fn(backend, gqa=True)
        try:
            grads_of(fn, inputs, dout)
            case(name, fn, note="enable_gqa=True", profile_it=True)
        except Exception as exc:
            case(
                name,
                sdpa_fn(backend, gqa=False),
                note=f"enable_gqa refused ({type(exc).__name__}: "
                f"{str(exc)[:300]}); K/V repeat_interleave'd inside the timed region",
                profile_it=True,
            )

    case("turbo_attention_cp1", lambda a, b_, c: tcp.attention(a, b_, c, causal=True), profile_it=True)
    if group is not None:
        for variant in tcp.VARIANTS:
            case(
                f"turbo_{variant}_ws1",
                lambda a, b_, c, _v=variant: tcp.context_parallel_attention(
                    a, b_, c, group=group, causal=True, variant=_v
                ),
                note="context_parallel_attention over a world-size-1 gloo group",
            )

    # (b) emulated cp > 1: the module's block functions over all ranks of the load-balanced split
    qb, kb, vb, db = (x.detach().transpose(1, 2) for x in (q, k, v, dout))  # [b, s, h, d] views
    for variant in tcp.VARIANTS:
        for cp in args.cps:
            name = f"emulated_{variant}_cp{cp}"
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                (o, dq, dk, dv), _ = emulate_cp(qb, kb, vb, db, cp, variant, scale)
                got = [x.transpose(1, 2) for x in (o, dq, dk, dv)]
                entry = {"errors_vs_fp32_ref": all_errors(got, refs)}
                del o, dq, dk, dv, got
                entry.update(time_emulated(qb, kb, vb, db, cp, variant, scale, args.warmup, args.iters))
                entry["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
                entry["tflops"] = round(flops / (entry["fwd_bwd_ms"] * 1e-3) / 1e12, 1)
                entry["blocks_per_rank"] = {
                    r: (
                        [(step, len(tcp._ring_blocks(r, (r - step) % cp, True, 1))) for step in range(cp)]
                        if variant == "ring"
                        else len(tcp._gathered_blocks(r, cp, True, 1))
                    )
                    for r in range(cp)
                }
            except Exception as exc:
                entry = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}
            cases[name] = entry
            print(f"[{seq}] {name}: " + json.dumps({k: entry.get(k) for k in ("fwd_bwd_ms", "error")}), flush=True)

    cases.get("sdpa_cudnn", {}).pop("outputs", None)
    ref_ms = cases.get("sdpa_cudnn", {}).get("fwd_bwd_ms")
    if ref_ms:
        res["ratio_fwd_bwd_vs_cudnn"] = {
            n: round(c["fwd_bwd_ms"] / ref_ms, 3) for n, c in cases.items() if "fwd_bwd_ms" in c
        }
    cp1_ms = cases.get("turbo_attention_cp1", {}).get("fwd_bwd_ms")
    if cp1_ms:
        res["ratio_fwd_bwd_vs_turbo_cp1"] = {
            n: round(c["fwd_bwd_ms"] / cp1_ms, 3) for n, c in cases.items() if "fwd_bwd_ms" in c
        }
    del q, k, v, dout, inputs, refs
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/cp_attention_h200.json")
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--no-group", dest="group", action="store_false", help="skip the world-size-1 gloo cases")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    props = torch.cuda.get_device_properties(0)
    record: dict[str, Any] = {
        "command": f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} python3 " + " ".join(sys.argv),
        "env": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "python": platform.python_version(),
            "gpu": props.name,
            "gpu_mem_gib": round(props.total_memory / 2**30, 1),
            "sm": f"{props.major}.{props.minor}",
            "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
            "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
        },
        "settings": {
            "warmup": args.warmup,
            "iters": args.iters,
            "timing": "median over iters, CUDA events, synchronize after each iteration; grads set to None before each",
            "cps": args.cps,
        },
    }
    group = None
    if args.group:
        try:
            fd, path = tempfile.mkstemp()
            os.close(fd)
            dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
            group = dist.group.WORLD
        except Exception as exc:
            record["group_error"] = f"{type(exc).__name__}: {exc}"
    results: dict[str, Any] = {}
    record["results"] = results

    def dump():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=lambda o: None)  # tensors left in by a failure: null

    for seq in args.seqs:
        try:
            run_seq(seq, args, group, results)
        except Exception as exc:
            results.setdefault(str(seq), {})["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        dump()
    if group is not None:
        dist.destroy_process_group()
    dump()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
