"""Kernel selection: one provider per op, by name or ``auto`` (highest priority available here).

The call contract of each op (what ``provider.load()`` returns), shared by every provider:

- ``attention(q, k, v, *, causal=True, scale=None) -> out``: q ``[b, h, s, d]``, k/v ``[b, h_kv, s, d]``
  with ``h % h_kv == 0`` (GQA, never materialising repeated K/V where the kernel allows).
- ``rms_norm(x, weight, eps) -> y`` over the last dim.
- ``swiglu(gate, up) -> silu(gate) * up``.
- ``cross_entropy(logits, target, ignore_index=-100) -> mean loss`` (fp32 accumulation).
- ``rope(x, cos, sin) -> x`` rotate-half convention, x ``[b, s, h, d]``, cos/sin ``[s, d]``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from primus.core.errors import UserError
from primus.core.protocols import KERNEL_OPS, KernelProvider

if TYPE_CHECKING:
    from primus.core.config.schema import KernelsConfig
    from primus.core.plugins import Registry

log = logging.getLogger("primus.kernels")

SELECTABLE_OPS = tuple(op for op in KERNEL_OPS if op != "gemm")


class KernelUnavailable(UserError, RuntimeError):
    pass


def detect_device() -> str:
    """``"cuda"``, ``"rocm"`` or ``"cpu"`` for this process (imports torch)."""
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


def select_kernels(
    kernels: KernelsConfig, registry: Registry, device: str, **constraints: object
) -> dict[str, KernelProvider]:
    """Pick a provider per op; log each choice once. A provider asked for by name that cannot run
    here raises :class:`KernelUnavailable` with its reason."""
    chosen: dict[str, KernelProvider] = {}
    for op in SELECTABLE_OPS:
        want = getattr(kernels, op)
        providers = registry.providers(op)
        if want != "auto":
            prov = next((p for p in providers if p.name == want), None)
            if prov is None:
                raise KernelUnavailable(
                    f"kernels.{op}: no provider named {want!r} is installed "
                    f"(installed: {', '.join(p.name for p in providers) or 'none'})"
                )
            ok = prov.check(device, **constraints)
            if not ok:
                raise KernelUnavailable(
                    f"kernels.{op}: provider {want!r} ({prov.dist}) is not available on {device}: {ok.reason}"
                )
            chosen[op] = prov
            log.info("%s: %s (asked for)", op, prov.name)
            continue
        reasons = []
        for prov in providers:
            ok = prov.check(device, **constraints)
            if ok:
                chosen[op] = prov
                log.info("%s: %s (auto)", op, prov.name)
                break
            reasons.append(f"{prov.name}: {ok.reason}")
        else:
            raise KernelUnavailable(
                f"kernels.{op}: no provider available on {device} ({'; '.join(reasons) or 'none installed'})"
            )
    return chosen
