"""What ``primus train`` and ``primus config validate`` check beyond the config itself, before anything is written:
the folders a run writes, what installed plugins refuse on this machine, ``--resume`` with nothing to resume, FP8
linears on a CPU.

Importing this module imports neither torch nor an engine (:func:`fp8_warning` imports torch to find the device,
only when FP8 is on and no device is given).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from primus.core.config.errors import ConfigError
from primus.core.config.validate import folder_issue

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.plugins import Registry


def check_folders(cfg: PrimusConfig) -> None:
    """Refuse (:class:`ConfigError`, exit 2) a run folder the run could not create or write: ``logging.output_dir``
    (default ``outputs/<recipe>``) and, where checkpoints are saved, ``checkpoint.dir``."""
    from primus.core.launch.train import output_dir
    from primus.core.run.loop import checkpoint_root

    issues = [issue] if (issue := folder_issue("logging.output_dir", output_dir(cfg))) else []
    # the default checkpoint folder lies in the output folder: one mistake, one message
    if cfg.checkpoint.enabled and (cfg.checkpoint.dir or not issues):
        issues += [issue] if (issue := folder_issue("checkpoint.dir", checkpoint_root(cfg))) else []
    if issues:
        raise ConfigError(issues)


def check_plugins(cfg: PrimusConfig, registry: Registry) -> None:
    """Refuse (:class:`ConfigError`, exit 2) what an installed plugin cannot do for this run on this machine
    (``primus_check_run``: GEMM tuning on a CPU, an offline tuning file that is not there)."""
    issues = [issue for result in registry.pm.hook.primus_check_run(config=cfg) for issue in result or ()]
    if issues:
        raise ConfigError(issues)


def has_complete_checkpoint(root: Path) -> bool:
    """Whether ``root`` holds a committed checkpoint: a folder named by :data:`primus.core.run.checkpoints.NAMING` (what
    core's loop writes) with its manifest, or, for a backend that runs its own loop under another naming, any
    folder whose manifest records its step."""
    from primus.core.run import checkpoints as ckpt

    if ckpt.complete_checkpoints(root, ckpt.NAMING):  # committed (whether it verifies is the resume's to say)
        return True
    if not root.is_dir():
        return False
    return any(
        p.is_dir() and not p.name.endswith(ckpt.TMP_SUFFIX) and "step" in (ckpt.read_manifest(p) or {})
        for p in root.iterdir()
    )


def resume_warning(cfg: PrimusConfig) -> str | None:
    """What to tell a user who passed ``--resume`` when there is nothing to resume (None when there is): the run
    would start from step 0, which after a mistyped folder only costs their time, but should not pass unsaid."""
    from primus.core.run.loop import checkpoint_root

    root = checkpoint_root(cfg)
    if has_complete_checkpoint(root):
        return None
    where = "does not exist" if not root.exists() else "holds no complete checkpoint"
    return (
        f"--resume: {root} {where}; this run starts from step 0, not from a checkpoint "
        "(check logging.output_dir / checkpoint.dir, or drop --resume to start fresh)"
    )


def fp8_warning(cfg: PrimusConfig, device: str | None = None) -> str | None:
    """FP8 on a CPU is honest but slow: primus-turbo's FP8 linear runs its GEMMs through ``torch._scaled_mm``,
    which torch 2.13 also runs on a CPU (with no FP8 hardware: the same e4m3/e5m2 rounding and scales, computed
    in software). Meaningful to check FP8 numerics (the project's FP8 tests do it), never faster than
    ``kernels.fp8=off``; say so. Where ``_scaled_mm`` does not run on the CPU, kernel selection refuses.
    ``device`` None: this process's (imports torch, only when FP8 is on)."""
    if cfg.kernels.fp8 == "off":
        return None
    if device is None:
        from primus.core.kernels import detect_device

        device = detect_device()
    if device != "cpu":
        return None
    scales = "one scale per tensor" if cfg.kernels.fp8 == "tensorwise" else "one scale per row"
    return (
        f"kernels.fp8={cfg.kernels.fp8} on CPU: there are no FP8 tensor cores here; the linears' GEMMs run FP8 "
        f"numerics (e4m3 operands, {scales}) through torch._scaled_mm in software: good for checking FP8 "
        "numerics, slower than kernels.fp8=off. Speed-ups need an FP8 GPU"
    )
