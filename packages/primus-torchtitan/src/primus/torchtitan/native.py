"""TorchTitan's own checkpoints, recognised for ``primus checkpoint import --from`` (``BackendSpec.native``,
:mod:`primus.core.contracts.native`): what ``torchtitan.train`` with ``--checkpoint.enable`` writes.

Its ``CheckpointManager`` (torchtitan 0.2.2) saves ``<dump_folder>/<checkpoint.folder>/step-N`` folders in
torch.distributed.checkpoint (DCP) format: ``.metadata`` (written last, once every shard is) and ``__R_0.distcp``
shards. The model's state-dict keys are flattened to the top level (``tok_embeddings.weight``, ``layers.0.…``); the
other states sit under their names: ``optimizer`` (its ``OptimizersContainer``, flattened per parameter:
``optimizer.state.<fqn>.exp_avg``), ``lr_scheduler``, ``dataloader`` and ``train_state`` (``step``,
``ntokens_seen``). The last save of a run holds the model alone unless ``checkpoint.last_save_model_only`` was turned
off (it is on by default), in ``checkpoint.export_dtype``; with ``checkpoint.last_save_in_hf`` it is a safetensors
folder instead. A step folder counts as complete, as torchtitan's own ``_find_load_step`` counts it, when it holds
``.metadata`` (or ``model.safetensors.index.json``); of a checkpoint folder, the newest complete one is taken.

This module reads file names and the DCP metadata only (and, where present, ``train_state.step``: a few bytes), with
no torchtitan import; the engine loads what it recognised (``load_native``, :mod:`primus.torchtitan.checkpoint`).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from primus.core.contracts.native import NativeCheckpoint

SOURCE = "TorchTitan"
#: a step folder's name, matched as torchtitan's CheckpointManager matches it (``re.search``)
STEP = re.compile(r"step-(\d+)")
DCP_METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"
#: the states torchtitan checkpoints beside the model, each flattened under its name
STATES = {
    "optimizer": "optimizer",
    "lr_scheduler": "LR scheduler",
    "dataloader": "data loader",
    "train_state": "train state",
}
#: what others write in a DCP folder (a Primus checkpoint: manifest.json; Megatron-Core torch_dist: metadata.json
#: and common.pt): never claimed
OTHERS = ("manifest.json", "metadata.json", "common.pt")
#: the keys every TorchTitan decoder model (llama3, qwen3, deepseek_v3, llama4) has
MODEL_KEYS = "tok_embeddings.weight, layers.N.*, norm.weight, output.weight"
_LAYER = re.compile(r"^layers\.(\d+)\.")


def step_of(name: str) -> int | None:
    match = STEP.search(name)
    return int(match[1]) if match else None


def complete(folder: Path) -> str | None:
    """``"dcp"`` or ``"hf"``: what makes ``folder`` a complete save by torchtitan's rule; None: not one."""
    if (folder / DCP_METADATA).is_file():
        return "dcp"
    if (folder / HF_INDEX).is_file():
        return "hf"
    return None


def model_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    """The model's tensors in a torchtitan DCP checkpoint (every tensor not under one of :data:`STATES`): name ->
    shape (whole, whatever layout saved it)."""
    return {
        key: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "size") and key.split(".", 1)[0] not in STATES
    }


def describe(shapes: dict[str, tuple[int, ...]]) -> str:
    """A model's kind and size from its tensors' names and shapes: ``"qwen3 MoE, 2 layers, hidden 128"``."""
    names = " ".join(shapes)
    kind = "deepseek_v3" if ".attention.wkv_a." in names else "qwen3" if ".attention.q_norm." in names else "llama3"
    if ".moe." in names:
        kind += "" if kind == "deepseek_v3" else " MoE"
    layers = {int(m[1]) for key in shapes if (m := _LAYER.match(key))}
    hidden = shapes.get("tok_embeddings.weight", (0, 0))[-1]
    return f"{kind}, {len(layers)} layers, hidden {hidden}"


def is_model(shapes: dict[str, tuple[int, ...]]) -> bool:
    return "tok_embeddings.weight" in shapes and any(_LAYER.match(key) for key in shapes)


def saved_step(folder: Path) -> int | None:
    """``train_state.step`` of a DCP checkpoint that holds it (one small pickled value), None where it cannot be
    read."""
    import torch.distributed.checkpoint as dcp

    state = {"train_state": {"step": 0}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process, as intended
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except Exception:  # a torn or foreign file: the folder's name gives the step
        return None
    return int(state["train_state"]["step"])


class TorchTitanFormat:
    """``BackendSpec.native`` of the torchtitan backend (:class:`primus.core.contracts.native.NativeFormat`)."""

    source = SOURCE
    expects = (
        "a TorchTitan checkpoint (torchtitan.train with --checkpoint.enable: a step-N folder in DCP format with "
        "its .metadata, or the checkpoint folder holding them)"
    )

    def recognise(self, path: Path) -> NativeCheckpoint | None:
        path = Path(path)
        if not path.is_dir() or any((path / name).exists() for name in OTHERS):
            return None
        if complete(path) == "dcp":
            return self._dcp(path)
        step = step_of(path.name)
        if step is not None and complete(path) == "hf":
            return self._hf(path, step)
        if step is not None and any(path.glob("*.distcp")):
            return self._incomplete(path, step)
        root = path
        steps = _step_folders(root)
        if not steps and (path / "checkpoint").is_dir():  # a run's dump folder: torchtitan's default checkpoint.folder
            root = path / "checkpoint"
            steps = _step_folders(root)
        if not steps:
            return None
        done = [(step, folder, kind) for step, folder in steps if (kind := complete(folder)) is not None]
        if not done:
            return NativeCheckpoint(
                SOURCE,
                root,
                steps[-1][0],
                f"TorchTitan checkpoint folder {root} ({len(steps)} step-N folders)",
                "none of its step-N folders is complete (no .metadata, which DCP writes last: saves cut short, e.g. "
                "an async save the run did not finish); expected a step-N folder holding .metadata",
            )
        step, folder, kind = done[-1]  # torchtitan's rule: the newest complete one
        return self._dcp(folder) if kind == "dcp" else self._hf(folder, step)

    def _dcp(self, folder: Path) -> NativeCheckpoint:
        from torch.distributed.checkpoint import FileSystemReader

        step = step_of(folder.name)
        try:
            metadata = FileSystemReader(str(folder)).read_metadata()
        except Exception as exc:  # torn, or another format's file of that name
            what = f"DCP folder {folder.name}"
            return NativeCheckpoint(SOURCE, folder, step or 0, what, f"its .metadata cannot be read ({exc})")
        shapes = model_shapes(metadata)
        tops = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
        if not is_model(shapes):
            sample = ", ".join(list(shapes or metadata.state_dict_metadata)[:4]) or "no tensors"
            return NativeCheckpoint(
                SOURCE,
                folder,
                step or 0,
                f"DCP checkpoint {folder.name}",
                f"its tensors are not a TorchTitan model's ({sample}, ...); expected {MODEL_KEYS} (a TorchTitan "
                "llama3 / qwen3 / deepseek_v3 checkpoint)",
            )
        optimizer = any(key.startswith("optimizer.state.") for key in metadata.state_dict_metadata)
        named = step
        if "train_state" in tops and (saved := saved_step(folder)) is not None:
            step = saved  # what torchtitan itself resumes at
        if step is None:
            step = 0  # a model alone in a folder not named step-N: weights only, no step to continue
        held = ["model", *(label for state, label in STATES.items() if state in tops)]
        dtype = str(metadata.state_dict_metadata["tok_embeddings.weight"].properties.dtype).removeprefix("torch.")
        name = folder.name if named == step else f"{folder.name}, step {step}"
        what = f"TorchTitan checkpoint {name} ({describe(shapes)}, {dtype}; {', '.join(held)})"
        details = {"model": describe(shapes), "states": sorted(tops & set(STATES)), "dtype": dtype}
        return NativeCheckpoint(SOURCE, folder, step, what, optimizer=optimizer, details=details)

    def _hf(self, folder: Path, step: int) -> NativeCheckpoint:
        return NativeCheckpoint(
            SOURCE,
            folder,
            step,
            f"TorchTitan checkpoint {folder.name} in Hugging Face safetensors (checkpoint.last_save_in_hf)",
            "it holds the weights alone, with no config.json: start a run from them with train.init_from=DIR, or "
            "import them with --from-hf, DIR being a Hugging Face folder of these safetensors and the model's "
            "config.json",
        )

    def _incomplete(self, folder: Path, step: int) -> NativeCheckpoint:
        siblings = [f"step-{s}" for s, f in _step_folders(folder.parent) if complete(f) == "dcp" and s != step]
        earlier = f" ({', '.join(siblings[-3:])} beside it)" if siblings else ""
        return NativeCheckpoint(
            SOURCE,
            folder,
            step,
            f"TorchTitan checkpoint {folder.name}",
            "its save is incomplete: shards without the .metadata DCP writes last (an async save the run did not "
            f"finish); expected a complete step-N folder{earlier}",
        )


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-N`` folder in ``root``, oldest first."""
    found = []
    for child in root.iterdir():
        if child.is_dir() and (step := step_of(child.name)) is not None:
            found.append((step, child))
    return sorted(found)


FORMAT = TorchTitanFormat()
