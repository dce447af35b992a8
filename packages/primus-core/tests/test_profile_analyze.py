"""The step-time report: interval arithmetic on a synthetic trace, kernel categories, a real CPU trace."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from primus.core.cli import app as cli
from primus.core.profile.analyze import analyze_events, analyze_files, categorize


def _k(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream, "pid": 0}


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def test_shares_of_a_synthetic_step():
    # window 0..90: gemm 0-40, allreduce 30-60 (10 overlapped, 20 exposed), flash 70-90, idle 60-70
    events = [
        _k(GEMM, 0, 40),
        _k(ALLREDUCE, 30, 30, stream=9),
        _k("flash_fwd_kernel", 70, 20),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
    ]
    r = analyze_events(events)
    assert (r.window_us, r.compute_us, r.exposed_comm_us, r.overlapped_comm_us, r.idle_us) == (90, 50, 20, 10, 10)
    assert r.categories == {"gemm": 40, "communication": 30, "attention": 20}
    assert sum(r.shares().values()) == pytest.approx(1.0)
    assert r.top[0] == (GEMM, 40, 1)


@pytest.mark.parametrize(
    "name,cat",
    [
        (GEMM, "gemm"),
        ("Cijk_Ailk_Bljk_BBS_BH_MT256x256x64_MI32x32x8x1", "gemm"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz", "gemm"),
        (ALLREDUCE, "communication"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
        ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128", "attention"),
        ("flash_bwd_dq_dk_dv_loop_kernel", "attention"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("rms_norm_kernel", "norm"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "elementwise"),
        ("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("void multi_tensor_apply_kernel<LAMBStage1Functor>", "optimizer"),
        ("lamb_update_kernel", "optimizer"),
        # a lambda functor is not the LAMB optimizer (it had put these in "optimizer")
        (
            "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor"
            "<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, "
            "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)"
            "::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast)",
            "elementwise",
        ),
        ("Memcpy DtoD (Device -> Device)", "memory"),
        ("LinearWithGradAccumulationAndAsyncCommunication", "gemm"),  # megatron's linear, outermost on a CPU trace
        ("autograd::engine::evaluate_function: AddmmBackward0", "gemm"),  # a CPU trace's backward GEMM
        ("some_unknown_thing", "other"),
        # inductor's fused FP8 cast feeding a GEMM is not one (a dtype copy); its GEMM templates are
        ("triton_poi_fused__to_copy_abs_clamp_clone_div_eq_mul_ne_reciprocal_scalar_tensor_scaled_mm_silu", "memory"),
        ("triton_tem_fused_mm_0", "gemm"),
        ("nvjet_sm90_qrtst_192x192_128x4_2x1_v_bz_coopB_TNN", "gemm"),
    ],
)
def test_categories(name, cat):
    assert categorize(name) == cat


# kernel names of a mixture-of-experts step (megatron's and TorchTitan's MoE layers on the H200; gloo on CPU)
GROUPED = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblemShapeE"
TOPK = "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float>)"
SCATTER = (
    "void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native::_cuda_scatter_gather_internal_kernel>"
)
GATHER = "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)"


def test_mixture_of_experts_categories():
    """Grouped GEMMs and all-to-alls by name anywhere; the routing kernels (top-k, sorting, gathers and scatters) only
    in a trace that has them: a dense model's gathers (the loss, the embedding) stay what they were."""
    assert categorize(GROUPED) == "grouped_gemm" and categorize("aten::_grouped_mm") == "grouped_gemm"
    assert categorize("gloo:all_to_all") == categorize("c10d::alltoall_base_") == "all_to_all"
    assert [categorize(n, moe=True) for n in (TOPK, SCATTER, GATHER, "aten::histc")] == ["routing"] * 4
    assert [categorize(n) for n in (SCATTER, GATHER)] == ["elementwise", "elementwise"]
    assert categorize(GEMM, moe=True) == "gemm" and categorize(ALLREDUCE, moe=True) == "communication"
    # a step: grouped GEMM 0-30, routing 30-40, an all-to-all 40-60 (communication: exposed), GEMM 60-80
    events = [_k(GROUPED, 0, 30), _k(TOPK, 30, 10), _k("gloo:all_to_all", 40, 20, stream=9), _k(GEMM, 60, 20)]
    r = analyze_events(events)
    assert r.categories == {"grouped_gemm": 30, "routing": 10, "all_to_all": 20, "gemm": 20}
    assert (r.compute_us, r.exposed_comm_us) == (60, 20)
    from primus.core.profile.report import markdown, shown_categories

    assert shown_categories([r])[:6] == ("gemm", "grouped_gemm", "attention", "norm", "elementwise", "routing")
    assert "grouped_gemm" not in shown_categories([analyze_events([_k(GEMM, 0, 40)])])
    assert "| rank | gemm | grouped_gemm |" in markdown([r])


def test_fp8_gemms_are_told_apart_by_name():
    """cuBLASLt's FP8 kernels (operand types q e4m3 / r e5m2 after the arch) against its bf16 ones (t), from the
    H200 traces; the report gives their share of GEMM time."""
    from primus.core.profile.report import markdown

    events = [
        _k("nvjet_sm90_qrtst_192x192_128x4_2x1_v_bz_coopB_TNN", 0, 30),
        _k("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN", 30, 20),
        _k("nvjet_sm90_qrsss_128x256_128x4_2x1_v_bz_coopA_TNN", 50, 10),
        _k("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", 60, 40),  # the bf16 output head
        _k("triton_poi_fused__to_copy_abs_clamp_mul_reciprocal_scaled_mm_0", 100, 5),
    ]
    r = analyze_events(events)
    assert r.categories["gemm"] == 100 and r.fp8_gemm_us == 60 and r.categories["memory"] == 5
    assert "FP8 GEMMs (FP8 operands, by kernel name), share of GEMM time: rank 0 60.0%" in markdown([r])
    assert "FP8 GEMMs" not in markdown([analyze_events([_k(GEMM, 0, 40)])])


def test_real_cpu_trace_and_cli(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            b = torch.nn.functional.silu(a @ a)
            a = b / b.norm()
    trace = tmp_path / "trace_rank0.json"
    prof.export_chrome_trace(str(trace))
    (report,) = analyze_files([trace])
    assert report.rank == "0" and report.window_us > 0
    assert report.categories.get("gemm", 0) > 0
    assert sum(report.shares().values()) == pytest.approx(1.0)
    res = CliRunner().invoke(cli.app, ["analyze", str(trace), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "rep" / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "rank 0" in page
    assert "| 0 |" in (tmp_path / "rep" / "report.md").read_text()


def test_bad_trace_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"nothing": 1}))
    res = CliRunner().invoke(cli.app, ["analyze", str(bad)])
    assert res.exit_code == 2 and "not a Chrome trace" in res.output


def test_cpu_training_step_trace_counts_nothing_twice(tmp_path):
    """A real CPU trace of a small transformer block's training steps: nested operators (aten::linear →
    aten::addmm → ...) are counted once, through their outermost operator, and the shares fill the window."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, schedule

    from primus.core.profile.analyze import _device_events, read_trace

    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(64, 4, 256, batch_first=True)
    opt = torch.optim.AdamW(block.parameters())
    x = torch.randn(4, 32, 64)
    path = tmp_path / "rank3.json"
    sched = schedule(wait=0, warmup=1, active=2, repeat=1)
    with profile(
        activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=lambda p: p.export_chrome_trace(str(path))
    ) as prof:
        for _ in range(3):
            block(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    events, _ = read_trace(path)
    (r,) = analyze_files([path], flops_per_step=1e9, peak_flops=1e12)
    top = _device_events(events)
    all_ops = sum(e["dur"] for e in events if e.get("cat") == "cpu_op")
    assert r.rank == "3" and r.steps == 2
    assert sum(r.categories.values()) == pytest.approx(sum(e["dur"] for e in top))
    assert sum(r.categories.values()) < all_ops  # nested operators were not added on top of their parents
    assert r.compute_us + r.idle_us == pytest.approx(r.window_us) and r.exposed_comm_us == 0
    # forward and backward GEMMs found through their outermost operators (a share would depend on the CPU's load)
    assert r.categories.get("gemm", 0) > 0, r.categories
    assert r.mfu == pytest.approx(1e9 / (r.window_us / 2 * 1e-6) / 1e12)


def test_many_ranks_report_and_mfu_column():
    from primus.core.profile.report import markdown

    r0 = analyze_events([_k(GEMM, 0, 80), _k(ALLREDUCE, 60, 40, stream=9)], "0", flops_per_step=5e6, peak_flops=1e12)
    r1 = analyze_events([_k(GEMM, 0, 100)], "1")
    assert r0.mfu == pytest.approx(5e6 / 100e-6 / 1e12) and r1.mfu is None
    md = markdown([r0, r1])
    assert "| 0 | 1 | 0.1 | 60.0% | 20.0% | 20.0% | 0.0% | 5.0% |" in md
    assert "| 1 | 1 | 0.1 | 100.0% | 0.0% | 0.0% | 0.0% | - |" in md
    assert "| mean of 2 | | 0.1 (max) | 80.0% | 10.0% | 10.0% | 0.0% |" in md


def test_a_run_folder_means_its_traces_not_its_summary(tmp_path):
    """``primus analyze RUN_DIR``: the run's traces/ (its summary.json, a JSON file beside them, is no trace)."""
    from primus.core.profile.analyze import find_traces

    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "rank0.json").write_text(json.dumps({"traceEvents": [_k(GEMM, 0, 10)]}))
    assert find_traces(tmp_path) == [tmp_path / "traces" / "rank0.json"]
    assert find_traces(tmp_path / "traces") == [tmp_path / "traces" / "rank0.json"]
