"""runtime.setup: what each mode does at train start, and the errors a run gets instead of silent no-ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from primus.core.config.schema import PrimusConfig
from primus.tune.results import Environment, GemmResults, GemmTuningMismatch, TuningEntry, pick_winner, read_results
from primus.tune.runtime import run_issues, setup
from primus.tune.searchers import NoSearcher, SearchBudget
from primus.tune.shapes import linear_gemms

H200 = Environment("NVIDIA H200", "cuda", "12.8", "cublasLt 120804", "2.11.0")


def _cfg(mode: str, path=None, compile: bool = False) -> PrimusConfig:
    kernels = {"gemm_tuning": mode} | ({"gemm_tuning_file": str(path)} if path else {})
    return PrimusConfig.model_validate({"kernels": kernels, "train": {"compile": compile}})


def test_off_does_nothing():
    tuning = setup(_cfg("off"), "cpu")
    model = nn.Linear(4, 4)
    assert tuning.apply(model) == 0 and "forward" not in vars(model)
    tuning.step_end(1)
    assert tuning.close() == {"mode": "off", "platform": "cpu"}


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_cpu_refuses_online_and_offline(mode, tmp_path):
    with pytest.raises(NoSearcher, match=f"kernels.gemm_tuning={mode}: GEMM tuning needs a GPU"):
        setup(_cfg(mode, tmp_path / "r.json"), "cpu")


def test_offline_needs_the_file_and_checks_where_it_was_made(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(FileNotFoundError, match="primus tune gemm run"):
        setup(_cfg("offline", path), "cuda", environment=H200)
    fwd, dgrad, wgrad = linear_gemms(8192, 2048, 2048)
    res = GemmResults(H200, searcher="cublaslt")
    res.add(TuningEntry(fwd, 690.0, 716.0, {"algorithm": "AA=="}, "tuned", "cublaslt"))
    res.add(TuningEntry(dgrad, 719.0, 623.0, {"algorithm": "AA=="}, "default", "cublaslt"))
    res.save(path)
    other = Environment("NVIDIA H100 80GB HBM3", "cuda", "12.8", "cublasLt 120804", "2.11.0")
    with pytest.raises(GemmTuningMismatch, match="H100"):
        setup(_cfg("offline", path), "cuda", environment=other, on_mismatch="refuse")

    tuning = setup(_cfg("offline", path), "cuda", environment=H200)
    assert set(tuning.plans.entries) == {fwd.key}  # only where the tuned algorithm won
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    assert tuning.apply(model) == 2
    out = model(torch.randn(3, 8))  # shapes not in the file run through torch
    assert out.shape == (3, 8) and tuning.plans.hits == {}
    compiled = setup(_cfg("offline", path, compile=True), "cuda", environment=H200)
    assert compiled.apply(nn.Linear(8, 8)) == 0  # nvmath would break every compiled graph: left to torch
    assert tuning.close() == {"mode": "offline", "platform": "cuda", "file": str(path), "shapes": 2, "tuned": 1,
                              "tuned_calls": 0}  # fmt: skip


def test_what_setup_would_refuse_is_said_before_the_run_with_the_key(tmp_path):
    path = tmp_path / "r.json"
    assert run_issues(_cfg("off"), "cpu") == []
    (cpu,) = run_issues(_cfg("online", path), "cpu")
    assert (cpu.path, cpu.value, cpu.allowed) == ("kernels.gemm_tuning", "online", "off on a CPU")
    assert "needs a GPU" in str(cpu)
    assert run_issues(_cfg("online", path), "cuda", environment=H200) == []  # online writes the file
    (missing,) = run_issues(_cfg("offline", path), "cuda", environment=H200)
    assert (missing.path, missing.value) == ("kernels.gemm_tuning_file", str(path))
    assert "primus tune gemm record" in missing.message
    path.write_text("{}")
    (bad,) = run_issues(_cfg("offline", path), "cuda", environment=H200)
    assert bad.message.startswith("not a GEMM tuning results file")
    GemmResults(H200, searcher="cublaslt").save(path)
    assert run_issues(_cfg("offline", path), "cuda", environment=H200) == []
    other = Environment("NVIDIA H100 80GB HBM3", "cuda", "12.8", "cublasLt 120804", "2.11.0")
    assert run_issues(_cfg("offline", path), "cuda", environment=other) == []  # warn: used, with a warning
    refuse = _cfg("offline", path).model_copy(deep=True)
    refuse.kernels.gemm_tuning_mismatch = "refuse"
    (elsewhere,) = run_issues(refuse, "cuda", environment=other)
    assert "made elsewhere" in elsewhere.message and "H100" in elsewhere.message


class OneWinnerSearcher:
    """Stands in for cuBLASLt: declares the first shape it is given faster, the others not."""

    name = "stand-in"

    def __init__(self):
        self.asked: list[list] = []

    def unsupported(self, shape):
        return None

    def tune(self, shapes, budget):
        self.asked.append(list(shapes))
        return [
            TuningEntry(s, 100.0, 110.0 if i == 0 else 90.0, {"algorithm": "AA=="}, pick_winner(100.0, 110.0 if i == 0 else 90.0), self.name)
            for i, s in enumerate(shapes)
        ]  # fmt: skip


def test_online_cuda_searches_shapes_as_they_appear_then_stops_and_writes(tmp_path):
    path = tmp_path / "online.json"
    searcher = OneWinnerSearcher()
    tuning = setup(_cfg("online", path), "cuda", environment=H200, searcher=searcher, online_steps=2,
                   budget=SearchBudget(max_seconds=5))  # fmt: skip
    model = nn.Linear(16, 8, bias=False)
    tuning.apply(model)
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()  # step 1: three GEMM shapes seen, none tuned yet
    tuning.step_end(1)
    assert len(searcher.asked) == 1 and len(searcher.asked[0]) == 3
    assert len(tuning.plans.entries) == 1  # the one that won dispatches from now on
    tuning.step_end(2)  # nothing new: no search
    assert len(searcher.asked) == 1
    summary = tuning.close()
    assert summary["shapes"] == 3 and summary["tuned"] == 1
    back = read_results(path)
    assert back.environment == H200 and len(back.entries) == 3 and len(back.tuned()) == 1


def test_online_rocm_tunes_with_tunableop_for_the_first_steps(tmp_path, fake_tunable):
    from primus.tune.searchers import TunableOpSearcher

    fake = fake_tunable([("GemmTunableOp_BFloat16_TN", "tn_48_64_32_ld_32_32_48", "Gemm_Hipblaslt_9", 0.5)], False)
    searcher = TunableOpSearcher(tunable=fake, device="cpu")
    path = tmp_path / "r.json"
    tuning = setup(_cfg("online", path), "rocm", environment=H200, searcher=searcher, online_steps=2)
    assert ("set_max_tuning_iterations", SearchBudget().iterations) in fake.calls and fake.tuning
    assert fake.calls[0] == ("set_filename", str(tmp_path / "r.tunableop.csv"))
    tuning.step_end(1)
    assert fake.tuning
    tuning.step_end(2)
    assert not fake.tuning  # bounded: tuning off after online_steps
    summary = tuning.close()
    assert summary["tuned"] == 1
    (entry,) = read_results(path).entries.values()
    assert entry.shape == linear_gemms(64, 32, 48)[0] and entry.solution["solution"] == "Gemm_Hipblaslt_9"


def test_online_shapes_left_over_by_the_time_budget_are_searched_after_the_next_step(tmp_path):
    from primus.tune.searchers import BUDGET_SPENT

    class OneShapePerStep(OneWinnerSearcher):
        def tune(self, shapes, budget):
            first, *rest = super().tune(shapes, budget)
            return [first] + [TuningEntry(s.shape, 0.0, searcher=self.name, note=BUDGET_SPENT) for s in rest]

    searcher = OneShapePerStep()
    tuning = setup(_cfg("online", tmp_path / "r.json"), "cuda", environment=H200, searcher=searcher, online_steps=3)
    model = nn.Linear(16, 8, bias=False)
    tuning.apply(model)
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    for step in (1, 2, 3):
        tuning.step_end(step)
    assert [len(a) for a in searcher.asked] == [3, 2, 1]
    assert tuning.close()["shapes"] == 3
