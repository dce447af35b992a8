"""What ``primus train`` checks beyond the config itself and its run folder (:class:`primus.core.run.rundir.RunFolder`),
before anything is written: what installed plugins refuse on this machine, FP8 linears on a CPU.

Importing this module imports neither torch nor an engine (:func:`fp8_warning` imports torch to find the device,
only when FP8 is on and no device is given).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from primus.core.config.errors import ConfigError

if TYPE_CHECKING:
    from primus.core.config.schema import PrimusConfig
    from primus.core.contracts.plugins import Registry


def check_plugins(cfg: PrimusConfig, registry: Registry) -> None:
    """Refuse (:class:`ConfigError`, exit 2) what an installed plugin cannot do for this run on this machine
    (``primus_check_run``: GEMM tuning on a CPU, an offline tuning file that is not there)."""
    issues = [issue for result in registry.pm.hook.primus_check_run(config=cfg) for issue in result or ()]
    if issues:
        raise ConfigError(issues)


def fp8_warning(cfg: PrimusConfig, device: str | None = None) -> str | None:
    """FP8 on a CPU is honest but slow: primus-turbo's FP8 linear runs its GEMMs through ``torch._scaled_mm``,
    which torch 2.13 also runs on a CPU (with no FP8 hardware: the same e4m3/e5m2 rounding and scales, computed
    in software). Meaningful to check FP8 numerics (the project's FP8 tests do it), never faster than
    ``kernels.fp8=off``; say so. Where ``_scaled_mm`` does not run on the CPU, kernel selection refuses.
    ``device`` None: this process's (imports torch, only when FP8 is on)."""
    if cfg.kernels.fp8 == "off":
        return None
    if device is None:
        from primus.core.kernels.selection import detect_device

        device = detect_device()
    if device != "cpu":
        return None
    scales = "one scale per tensor" if cfg.kernels.fp8 == "tensorwise" else "one scale per row"
    return (
        f"kernels.fp8={cfg.kernels.fp8} on CPU: there are no FP8 tensor cores here; the linears' GEMMs run FP8 "
        f"numerics (e4m3 operands, {scales}) through torch._scaled_mm in software: good for checking FP8 "
        "numerics, slower than kernels.fp8=off. Speed-ups need an FP8 GPU"
    )
