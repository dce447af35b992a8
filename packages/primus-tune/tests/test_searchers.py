"""Searcher selection and errors, the TunableOp searcher's contract against a recording stand-in for
torch.cuda.tunable (no ROCm here), and the hipblaslt-bench command lines."""

from __future__ import annotations

import sys

import pytest

from primus.tune import hipblaslt
from primus.tune.searchers import (
    CublasLtSearcher,
    NoSearcher,
    SearchBudget,
    TunableOpSearcher,
    select_searcher,
    shape_from_tunableop,
    tunableop_csv,
)
from primus.tune.shapes import GemmShape, linear_gemms


def test_cpu_has_no_searcher_and_says_what_to_do():
    with pytest.raises(NoSearcher, match="needs a GPU.*this machine is cpu.*gemm_tuning=off"):
        select_searcher("cpu")


def test_cuda_without_nvmath_is_refused_with_the_package_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvmath", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "nvmath.linalg", None)
    monkeypatch.setitem(sys.modules, "nvmath.linalg.advanced", None)
    with pytest.raises(NoSearcher, match="nvmath-python"):
        select_searcher("cuda")
    with pytest.raises(NoSearcher):
        CublasLtSearcher()


@pytest.mark.parametrize("with_write_file", [True, False])
def test_tunableop_searcher_contract(with_write_file, fake_tunable):
    fwd, dgrad, _ = linear_gemms(64, 32, 48, dtype="float32")
    rows = [
        ("GemmTunableOp_float_TN", "tn_48_64_32_ld_32_32_48", "Gemm_Hipblaslt_1234", 0.01),
        ("GemmTunableOp_float_NN", "nn_32_64_48_ld_32_48_32", "Default", 0.02),
    ]
    fake = fake_tunable(rows, with_write_file)
    searcher = TunableOpSearcher(tunable=fake, device="cpu")
    assert searcher.writes_in_real_time is not with_write_file
    bmm = GemmShape("bmm", 8, 8, 8, batch=4)
    entries = searcher.tune([fwd, dgrad, bmm], SearchBudget(iterations=7, repeats=2, inner=1), filename="t.csv")

    assert ("set_max_tuning_iterations", 7) in fake.calls and ("set_filename", "t.csv") in fake.calls
    assert fake.calls[-1 - with_write_file] == ("tuning_enable", False)  # tuning is off at the end
    assert (("write_file",) in fake.calls) is with_write_file  # torch < 2.10 must save explicitly
    e_fwd, e_dgrad, e_bmm = entries
    assert e_fwd.solution["solution"] == "Gemm_Hipblaslt_1234" and e_fwd.default_tflops > 0
    assert e_dgrad.winner == "default"  # TunableOp itself kept the default
    assert e_bmm.solution is None and "not searched" in e_bmm.note
    # the TunableOp rows map back to the recorded torch shapes
    assert shape_from_tunableop(*rows[0][:2]) == fwd
    assert shape_from_tunableop(*rows[1][:2]) == dgrad


def test_tunableop_csv_holds_only_winners():
    fwd, dgrad, _ = linear_gemms(64, 32, 48)
    from primus.tune.results import TuningEntry

    sol = {
        "op": "GemmTunableOp_BFloat16_TN",
        "params": "tn_48_64_32_ld_32_32_48",
        "solution": "Gemm_Rocblas_7",
        "ms": 0.5,
    }
    text = tunableop_csv(
        [TuningEntry(fwd, 1.0, 2.0, sol, "tuned"), TuningEntry(dgrad, 2.0, 1.0, {**sol, "solution": "x"}, "default")],
        [("PT_VERSION", "2.11.0")],
    )
    assert text == "Validator,PT_VERSION,2.11.0\nGemmTunableOp_BFloat16_TN,tn_48_64_32_ld_32_32_48,Gemm_Rocblas_7,0.5\n"


def test_tunableop_without_the_api_is_refused():
    with pytest.raises(NoSearcher, match="torch >= 2.5"):
        TunableOpSearcher(tunable=object())


def test_hipblaslt_bench_command_for_a_linear_forward():
    fwd = linear_gemms(8192, 2048, 512)[0]  # x·Wᵀ: torch NT -> BLAS transA T, m = out features
    cmd = hipblaslt.bench_command(fwd)
    assert cmd[:2] == ["hipblaslt-bench", "--api_method"]
    args = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert args["-m"] == "512" and args["-n"] == "8192" and args["-k"] == "2048"
    assert args["--transA"] == "T" and args["--transB"] == "N"
    assert args["--a_type"] == "bf16_r" and args["--d_type"] == "bf16_r" and args["--compute_type"] == "f32_r"
    with pytest.raises(ValueError, match="no hipblaslt-bench type"):
        hipblaslt.bench_command(GemmShape("mm", 4, 4, 4, dtype="int8", out_dtype="int32"))


def test_hipblaslt_logged_lines_become_search_commands():
    log = [
        "noise",
        "hipblaslt-bench --api_method c -m 512 -n 8192 -k 2048 --transA T --transB N --a_type bf16_r "
        "--algo_method index --solution_index 56537 --iters 0 --cold_iters 0 --rotating 0",
        "hipblaslt-bench --api_method c -m 512 -n 8192 -k 2048 --transA T --transB N --a_type bf16_r "
        "--algo_method index --solution_index 56537 --iters 0 --cold_iters 0 --rotating 0",
    ]
    (cmd,) = hipblaslt.tuning_commands(log, iters=20, cold_iters=20)
    assert "--algo_method" not in cmd and "--solution_index" not in cmd
    assert cmd[cmd.index("--requested_solution") + 1] == "-1"
    assert cmd.count("--iters") == 1 and cmd[cmd.index("--iters") + 1] == "20"
    assert cmd[cmd.index("--rotating") + 1] == "512" and "--skip_slow_solution_ratio" in cmd
    assert cmd[cmd.index("-m") + 1] == "512" and cmd[cmd.index("--transA") + 1] == "T"
    assert hipblaslt.dump_env("/tmp/g_%i.log") == {"HIPBLASLT_LOG_MASK": "32", "HIPBLASLT_LOG_FILE": "/tmp/g_%i.log"}
    assert hipblaslt.override_env("t.txt") == {"HIPBLASLT_TUNING_OVERRIDE_FILE": "t.txt"}


def test_hipblaslt_path_is_offered_only_where_the_tool_exists(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hipblaslt.bench_tool() is None
    with pytest.raises(FileNotFoundError, match="hipblaslt-bench is not on PATH"):
        hipblaslt.run_tuning([["hipblaslt-bench"]], tmp_path / "t.txt")


def test_tunableop_reports_a_shape_it_had_already_tuned(fake_tunable):
    fwd = linear_gemms(64, 32, 48, dtype="float32")[0]
    fake = fake_tunable([], False)
    fake.found.append(
        ("GemmTunableOp_float_TN", "tn_48_64_32_ld_32_32_48", "Gemm_Rocblas_3", 0.01)
    )  # read_file earlier
    (entry,) = TunableOpSearcher(tunable=fake, device="cpu").tune([fwd], SearchBudget(repeats=2, inner=1))
    assert entry.solution["solution"] == "Gemm_Rocblas_3" and not entry.note
