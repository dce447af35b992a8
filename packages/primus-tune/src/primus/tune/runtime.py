"""GEMM tuning in a training run: what a backend calls. Four calls, all cheap when tuning is off::

    from primus.tune.runtime import setup
    tuning = setup(cfg, device)          # at train start, after the model is built; device: "cuda"/"rocm"/"cpu"
    tuning.apply(model)                  # route the model's nn.Linear GEMMs through tuned plans (CUDA)
    ...  tuning.step_end(step)           # after each optimizer step (online mode searches here)
    summary = tuning.close()             # at the end: online results written; a dict for the run summary

Modes (``kernels.gemm_tuning``):

- ``off``: nothing happens.
- ``online``: ROCm: PyTorch TunableOp searches each new GEMM shape during the first ``online_steps`` steps (at
  most ``budget.iterations`` tuning iterations per shape), then tuning stops and the tuned solutions stay in
  use. CUDA: the linears' GEMM shapes seen during a step are searched after it (cuBLASLt through nvmath,
  ``budget.max_seconds`` per step) for the first ``online_steps`` steps; the winners dispatch from the next step.
  The results go to ``kernels.gemm_tuning_file`` at :meth:`GemmTuning.close` (rank 0), reusable offline.
- ``offline``: ``kernels.gemm_tuning_file`` (made by ``primus tune gemm run``) is loaded and checked against
  this device and library versions (``on_mismatch``: ``warn`` or ``refuse``). CUDA: linears dispatch to the
  tuned cuBLASLt algorithms where they won. ROCm: the winners are handed to TunableOp (``read_file``) with
  tuning off.

On CPU ``online`` and ``offline`` are refused (:class:`~primus.tune.searchers.NoSearcher`): nothing to tune.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from primus.core.contracts.protocols import ConfigIssue
from primus.tune.results import (
    Environment,
    GemmResults,
    GemmTuningMismatch,
    TuningEntry,
    check_environment,
    current_environment,
    load_results,
    read_results,
)
from primus.tune.searchers import (
    BUDGET_SPENT,
    NoSearcher,
    SearchBudget,
    Searcher,
    select_searcher,
    shape_from_tunableop,
    tunableop_csv,
)

log = logging.getLogger("primus.tune")
NEEDS_GPU = "GEMM tuning needs a GPU (TunableOp on ROCm, cuBLASLt on CUDA)"  # run_issues' and setup's refusal


def platform_of(device: Any) -> str:
    """``"cuda"``/``"rocm"``/``"cpu"`` from that string or a ``torch.device``."""
    if isinstance(device, str) and device in ("cuda", "rocm", "cpu"):
        return device
    if getattr(device, "type", str(device).split(":")[0]) == "cpu":
        return "cpu"
    import torch

    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def results_path(cfg: Any) -> Path:
    from primus.tune.gemm import default_results_file

    return Path(cfg.kernels.gemm_tuning_file or default_results_file(cfg.model_dump(mode="json")))


def run_issues(cfg: Any, device: str, environment: Environment | None = None) -> list[ConfigIssue]:
    """What :func:`setup` would refuse for a run of ``cfg`` on ``device``, said before the run writes anything
    (``primus_check_run``): tuning on a CPU; an offline file that is missing, unreadable, or made elsewhere under
    ``kernels.gemm_tuning_mismatch: refuse``. ``environment`` replaces the detected one (tests)."""
    k = cfg.kernels
    if k.gemm_tuning == "off":
        return []
    if platform_of(device) == "cpu":
        why = f"{NEEDS_GPU}; this machine has none"
        return [ConfigIssue("kernels.gemm_tuning", why, value=k.gemm_tuning, allowed="off on a CPU")]
    if k.gemm_tuning != "offline":
        return []
    path = results_path(cfg)
    try:
        results = read_results(path)
        if k.gemm_tuning_mismatch == "refuse":  # (a file that only warns is said once, by setup on the rank)
            check_environment(results, environment or current_environment(), "refuse", source=str(path))
    except FileNotFoundError:
        why = f"{path} does not exist; make it on this GPU (primus tune gemm record, then primus tune gemm run)"
        return [ConfigIssue("kernels.gemm_tuning_file", why, value=str(path), allowed="a results file, or online")]
    except GemmTuningMismatch as exc:
        return [ConfigIssue("kernels.gemm_tuning_file", str(exc), allowed="kernels.gemm_tuning_mismatch=warn")]
    except (OSError, ValueError) as exc:  # unreadable, or not a results file
        return [ConfigIssue("kernels.gemm_tuning_file", f"not a GEMM tuning results file: {exc}", value=str(path))]
    return []


@dataclass
class GemmTuning:
    """What :func:`setup` returns; see the module docstring."""

    mode: str
    platform: str
    results_file: Path | None = None
    results: GemmResults | None = None
    searcher: Searcher | None = None
    plans: Any = None  # dispatch.NvmathPlans on CUDA
    online_steps: int = 0
    budget: SearchBudget = field(default_factory=SearchBudget)
    rank: int = 0
    compiled: bool = False
    patched: int = 0
    _tuned_keys: set[str] = field(default_factory=set)
    _stopped: bool = False

    def apply(self, model: Any) -> int:
        """Route ``model``'s ``nn.Linear`` modules through :func:`~primus.tune.dispatch.tuned_linear` (CUDA, when
        tuning is on). ROCm needs nothing: TunableOp works below ``torch.mm``. Returns the number patched."""
        if self.plans is None:
            return 0
        if self.compiled:
            # nvmath calls are opaque to torch.compile: a graph break at every linear would cost more than tuning wins
            log.warning("gemm tuning: train.compile is on; linears are left to torch (tuned dispatch runs eager only)")
            return 0
        from primus.tune.dispatch import patch_linears

        self.patched += patch_linears(model, self.plans)
        log.info("gemm tuning: %d linears dispatch through tuned GEMMs where they won", self.patched)
        return self.patched

    def step_end(self, step: int) -> None:
        if self.mode != "online" or self._stopped:
            return
        if self.platform == "rocm":
            if step >= self.online_steps:
                self.searcher.stop()
                self._stopped = True
                log.info("gemm tuning: TunableOp tuning stopped after step %d", step)
            return
        new = [s for k, s in self.plans.misses.items() if k not in self._tuned_keys]
        if new:
            t0 = time.perf_counter()
            for entry in self.searcher.tune(new, self.budget):
                self._record(entry)
            log.info("gemm tuning: step %d: searched %d shapes in %.1fs", step, len(new), time.perf_counter() - t0)
        if step >= self.online_steps:
            self._stopped = True

    def _record(self, entry: TuningEntry) -> None:
        if entry.note == BUDGET_SPENT:
            return  # searched after a later step
        self._tuned_keys.add(entry.shape.key)
        self.results.add(entry)
        if entry.winner == "tuned":
            self.plans.add(entry)

    def close(self) -> dict[str, Any]:
        """Online: write the results file (rank 0). Returns a summary for the run's log."""
        if self.mode == "online" and self.platform == "rocm" and not self._stopped:
            self.searcher.stop()
            self._stopped = True
        if self.mode == "online" and self.platform == "rocm":
            self._collect_tunableop()
        if self.mode == "online" and self.results is not None and self.rank == 0 and self.results.entries:
            self.results.save(self.results_file)
        return self.summary()

    def _collect_tunableop(self) -> None:
        # TunableOp keeps its own CSV (written in real time on torch >= 2.10); the JSON file lists what it chose.
        self.results.extra["tunableop_validators"] = self.searcher.validators()
        for op, params, solution, ms in self.searcher.results():
            shape = shape_from_tunableop(op, params)
            if shape is not None:
                winner = "default" if solution == "Default" else "tuned"
                sol = {"op": op, "params": params, "solution": solution, "ms": ms}
                tflops = shape.flops / (ms * 1e-3) / 1e12 if ms > 0 else 0.0
                self.results.add(TuningEntry(shape, 0.0, tflops, sol, winner, "tunableop", "online (TunableOp)"))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "platform": self.platform}
        if self.results_file:
            out["file"] = str(self.results_file)
        if self.results is not None:
            entries = self.results.entries.values()
            out["shapes"] = len(self.results.entries)
            out["tuned"] = sum(e.winner == "tuned" for e in entries)
        if self.plans is not None:
            out["tuned_calls"] = sum(self.plans.hits.values())
            if getattr(self.plans, "unaligned", 0):  # tuned shape, operand not aligned as searched: torch ran it
                out["unaligned_calls"] = self.plans.unaligned
        return out


def setup(
    cfg: Any,
    device: Any,
    *,
    on_mismatch: Literal["warn", "refuse"] | None = None,
    online_steps: int | None = None,
    budget: SearchBudget | None = None,
    environment: Environment | None = None,
    searcher: Searcher | None = None,
) -> GemmTuning:
    """Prepare GEMM tuning for a run of ``cfg`` (a validated ``PrimusConfig``) on ``device`` (``"cuda"``,
    ``"rocm"``, ``"cpu"`` or a ``torch.device``). ``on_mismatch``: what an offline file made for another device
    or version does (``warn`` and use it, or ``refuse``). ``online_steps``/``budget`` bound online search.
    Left out, these three come from the config (``kernels.gemm_tuning_mismatch``, ``_online_steps``,
    ``_candidates`` / ``_iterations`` / ``_max_seconds``). ``environment``/``searcher`` replace the detected ones
    (tests)."""
    k = cfg.kernels
    mode = k.gemm_tuning
    platform = platform_of(device)
    on_mismatch = on_mismatch or k.gemm_tuning_mismatch
    online_steps = online_steps or k.gemm_tuning_online_steps
    budget = budget or SearchBudget(
        limit=k.gemm_tuning_candidates, iterations=k.gemm_tuning_iterations, max_seconds=k.gemm_tuning_max_seconds
    )
    rank = int(os.environ.get("RANK", "0"))
    compiled = bool(getattr(cfg.train, "compile", False))
    if mode == "off":
        return GemmTuning("off", platform)
    if platform == "cpu":
        raise NoSearcher(f"kernels.gemm_tuning={mode}: {NEEDS_GPU}; this run is on CPU. Set kernels.gemm_tuning=off.")
    path = results_path(cfg)
    env = environment or current_environment()
    if mode == "offline":
        results = load_results(path, env, on_mismatch)
        tuning = GemmTuning("offline", platform, path, results, rank=rank, compiled=compiled)
        if platform == "cuda":
            from primus.tune.dispatch import NvmathPlans

            tuning.plans = NvmathPlans(results.tuned())
        else:
            _load_into_tunableop(results, path)
        log.info("gemm tuning: offline, %d of %d shapes tuned (%s)", len(results.tuned()), len(results.entries), path)
        return tuning
    searcher = searcher or select_searcher(platform)
    results = GemmResults(env, searcher=searcher.name)
    tuning = GemmTuning(
        "online",
        platform,
        path,
        results,
        searcher,
        online_steps=online_steps,
        budget=budget,
        rank=rank,
        compiled=compiled,
    )
    if platform == "cuda":
        from primus.tune.dispatch import NvmathPlans

        tuning.plans = NvmathPlans({})
    else:
        csv = path.with_suffix(".tunableop.csv")
        csv.parent.mkdir(parents=True, exist_ok=True)
        searcher.start(str(csv), budget.iterations)
    log.info("gemm tuning: online for %d steps (%s)", online_steps, searcher.name)
    return tuning


def _load_into_tunableop(results: GemmResults, path: Path) -> None:
    import torch.cuda.tunable as tunable

    csv = path.with_suffix(".tunableop.csv")
    csv.write_text(tunableop_csv(list(results.entries.values()), results.extra.get("tunableop_validators", [])))
    tunable.enable(True)
    tunable.tuning_enable(False)
    tunable.read_file(str(csv))
