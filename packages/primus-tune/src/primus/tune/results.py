"""The GEMM tuning results file: per shape, default vs tuned TF/s, the chosen solution and the winner, keyed by
the environment that measured it (device, BLAS library, runtime and torch versions).

JSON, one file per model and precision (:func:`primus.tune.gemm.default_results_file`)::

    {"format": "primus-gemm-results/1",
     "environment": {"device": "NVIDIA H200", "platform": "cuda", "runtime": "12.8", "blas": "cublasLt 120804",
                     "torch": "2.11.0"},
     "searcher": "cublaslt",
     "entries": [{"shape": {...GemmShape}, "default_tflops": 690.1, "tuned_tflops": 716.3,
                  "solution": {...opaque, per searcher}, "winner": "tuned", "searcher": "cublaslt"}]}

A solution is opaque outside its searcher: for ``cublaslt`` the cuBLASLt algorithm (nvmath ``Algorithm``
serialized, base64) and its id; for ``tunableop`` TunableOp's solution string and its results-CSV row.
Loading checks the environment (:func:`check_environment`): another device or version warns or refuses.
Importing this module does not import torch (``primus tune gemm show`` stays light).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from primus.tune.shapes import GemmShape

log = logging.getLogger("primus.tune")

RESULTS_FORMAT = "primus-gemm-results/1"
ENV_KEYS = ("device", "platform", "runtime", "blas", "torch")


class GemmTuningMismatch(RuntimeError):
    """A results file made on another device or with other library versions, refused."""


@dataclass(frozen=True)
class Environment:
    device: str  # torch.cuda.get_device_name(), or "cpu"
    platform: str  # "cuda", "rocm" or "cpu"
    runtime: str = ""  # CUDA or HIP version torch was built with
    blas: str = ""  # "cublasLt <version>" or "hipblaslt <version>"
    torch: str = ""

    def differences(self, other: Environment) -> list[str]:
        return [
            f"{k}: file {getattr(other, k)!r}, here {getattr(self, k)!r}"
            for k in ENV_KEYS
            if getattr(self, k) != getattr(other, k)
        ]


def current_environment(device_index: int = 0) -> Environment:
    """The environment of this process (imports torch; nvmath or TunableOp only to read library versions)."""
    import torch

    if not torch.cuda.is_available():
        return Environment(device="cpu", platform="cpu", torch=torch.__version__)
    name = torch.cuda.get_device_name(device_index)
    if getattr(torch.version, "hip", None):
        return Environment(name, "rocm", str(torch.version.hip), _hipblaslt_version(), torch.__version__)
    return Environment(name, "cuda", str(torch.version.cuda), _cublaslt_version(), torch.__version__)


def _cublaslt_version() -> str:
    try:
        from nvmath.bindings import cublasLt

        return f"cublasLt {cublasLt.get_version()}"
    except Exception:  # nvmath not installed or no library: the file still records device and runtime
        return "cublasLt unknown"


def _hipblaslt_version() -> str:
    try:
        import torch.cuda.tunable as tunable

        validators = dict(tunable.get_validators())
        return f"hipblaslt {validators.get('HIPBLASLT_VERSION', 'unknown')}"
    except Exception:
        return "hipblaslt unknown"


@dataclass
class TuningEntry:
    shape: GemmShape
    default_tflops: float
    tuned_tflops: float | None = None
    solution: Any = None  # opaque per searcher
    winner: Literal["default", "tuned"] = "default"
    searcher: str = ""
    note: str = ""  # why a shape was not tuned, when it was not

    @property
    def gain(self) -> float | None:
        if not self.tuned_tflops or not self.default_tflops:
            return None
        return self.tuned_tflops / self.default_tflops - 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = self.shape.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuningEntry:
        return cls(**{**data, "shape": GemmShape.from_dict(data["shape"])})


def pick_winner(default_tflops: float, tuned_tflops: float | None, min_gain: float = 0.0) -> str:
    """``tuned`` only when it beats the default by more than ``min_gain`` (a fraction): ties keep the default."""
    if tuned_tflops is None or default_tflops <= 0:
        return "default"
    return "tuned" if tuned_tflops > default_tflops * (1.0 + min_gain) else "default"


@dataclass
class GemmResults:
    environment: Environment
    entries: dict[str, TuningEntry] = field(default_factory=dict)  # by GemmShape.key
    searcher: str = ""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    extra: dict[str, Any] = field(default_factory=dict)  # searcher-specific (TunableOp's validators)

    def add(self, entry: TuningEntry) -> None:
        self.entries[entry.shape.key] = entry

    def tuned(self) -> dict[str, TuningEntry]:
        """The entries whose tuned solution won: the only shapes dispatch routes away from the default."""
        return {k: e for k, e in self.entries.items() if e.winner == "tuned" and e.solution is not None}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RESULTS_FORMAT,
            "created": self.created,
            "environment": asdict(self.environment),
            "searcher": self.searcher,
            "entries": [e.to_dict() for e in sorted(self.entries.values(), key=lambda e: e.shape)],
            "extra": self.extra,
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)  # readers never see half a file
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmResults:
        if data.get("format") != RESULTS_FORMAT:
            raise ValueError(f"not a GEMM results file (format {data.get('format')!r}, want {RESULTS_FORMAT!r})")
        entries = [TuningEntry.from_dict(e) for e in data.get("entries", [])]
        return cls(
            environment=Environment(**data["environment"]),
            entries={e.shape.key: e for e in entries},
            searcher=data.get("searcher", ""),
            created=data.get("created", ""),
            extra=data.get("extra", {}),
        )


def read_results(path: str | Path) -> GemmResults:
    """Read a results file without checking where it was made (``primus tune gemm show``)."""
    try:
        return GemmResults.from_dict(json.loads(Path(path).read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def check_environment(
    results: GemmResults, here: Environment, on_mismatch: Literal["warn", "refuse"] = "warn", source: str = ""
) -> list[str]:
    """Compare the file's environment with ``here``. ``refuse`` raises :class:`GemmTuningMismatch` on any
    difference; ``warn`` logs it and returns the differences (the caller still uses the file)."""
    if on_mismatch not in ("warn", "refuse"):
        raise ValueError(f"on_mismatch must be 'warn' or 'refuse', got {on_mismatch!r}")
    diffs = here.differences(results.environment)
    if diffs:
        text = f"GEMM tuning results {source or ''} were made elsewhere: " + "; ".join(diffs)
        if on_mismatch == "refuse":
            raise GemmTuningMismatch(text + " (tune again here: primus tune gemm run)")
        log.warning("%s; using them anyway", text)
    return diffs


def load_results(path: str | Path, here: Environment, on_mismatch: Literal["warn", "refuse"] = "warn") -> GemmResults:
    """Read a results file and check it against this environment (see :func:`check_environment`)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"GEMM tuning results file {path} does not exist (make it: primus tune gemm run)")
    results = read_results(path)
    check_environment(results, here, on_mismatch, source=str(path))
    return results
