"""``primus`` (core's CLI) in a fresh process, with test-only changes made in that process first:

- ``PRIMUS_TEST_NAN_AT=N``: the loss of every micro-batch of step N is multiplied by NaN (a real NaN
  flowing through the backward pass into the gradients and the grad norm).
- ``PRIMUS_TEST_COUNTING=path``: registers kernel providers named ``counting`` for attention, rms_norm,
  swiglu and cross_entropy that count their calls (rank r's written to ``path.r`` as JSON at the end of
  the run) and compute with core's reference implementations.
- ``PRIMUS_TEST_TRITON_ON_CPU=1``: primus-turbo's Triton providers count as available on the CPU; run
  with ``TRITON_INTERPRET=1`` they execute in Triton's interpreter (the real kernels, numpy-backed).
- ``PRIMUS_TEST_DUMP_MODEL=path``: at the end of the run, the whole model as trained (every parameter, whole
  tensors in their own dtype, torchtitan's names) is saved to ``path`` by rank 0 (``torch.save``).

Usage: ``python drive.py train CONFIG overrides...`` (under torchrun for several processes).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

from primus.core import hookimpl
from primus.core.contracts import plugins
from primus.core.contracts.protocols import Availability, KernelProvider
from primus.core.kernels import reference


def poison_step(step: int) -> None:
    from primus.torchtitan import engine as runner

    build = runner.build_trainer

    def build_trainer(*args, **kwargs):
        trainer = build(*args, **kwargs)
        loss_fn = trainer.loss_fn

        def loss(pred, labels):
            out = loss_fn(pred, labels)
            return out * float("nan") if trainer.step == step else out

        trainer.loss_fn = loss
        return trainer

    runner.build_trainer = build_trainer


def counting_providers(path: str) -> None:
    calls: Counter[str] = Counter()

    def counted(op: str):
        fn = getattr(reference, op)

        def impl(*args, **kwargs):
            calls[op] += 1
            return fn(*args, **kwargs)

        return impl

    class Counting:
        @staticmethod
        @hookimpl
        def primus_kernels():
            return [
                KernelProvider(op, "counting", counted(op), lambda device, **_: Availability(True), priority=-1)
                for op in ("attention", "rms_norm", "swiglu", "cross_entropy")
            ]

        @staticmethod
        @hookimpl
        def primus_on_train_end(summary, info):
            with open(f"{path}.{info.rank}", "w") as f:
                json.dump(calls, f)

    plugins._cached = plugins.Registry(plugins.build_plugin_manager(extra_plugins=[("counting", Counting)]))


def dump_model(path: str) -> None:
    from primus.torchtitan import engine as runner

    close = runner.TorchTitanEngine.close

    def closing(self):
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0
        sd = {k: v for part in self.model_parts for k, v in get_model_state_dict(part, options=options).items()}
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(sd, path)
        close(self)

    runner.TorchTitanEngine.close = closing


def triton_on_cpu() -> None:
    import primus.turbo.availability as availability

    availability.triton_kernels = lambda device, **_: Availability(True)


if __name__ == "__main__":
    if os.environ.get("PRIMUS_TEST_NAN_AT"):
        poison_step(int(os.environ["PRIMUS_TEST_NAN_AT"]))
    if os.environ.get("PRIMUS_TEST_COUNTING"):
        counting_providers(os.environ["PRIMUS_TEST_COUNTING"])
    if os.environ.get("PRIMUS_TEST_TRITON_ON_CPU"):
        triton_on_cpu()
    if os.environ.get("PRIMUS_TEST_DUMP_MODEL"):
        dump_model(os.environ["PRIMUS_TEST_DUMP_MODEL"])
    from primus.core.cli.app import entry

    sys.argv = ["primus", *sys.argv[1:]]
    entry()  # as the primus command: out without the interpreter's teardown (a gloo job aborts in it at times)
