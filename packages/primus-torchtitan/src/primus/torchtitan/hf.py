"""Hugging Face <-> torchtitan models, through the state-dict adapter of each model family
(:mod:`primus.torchtitan.state_dict`: torchtitan's own, and Primus's where they lack a part).

``train.init_from`` with a HF folder fills each rank's model parts through the adapter, layer by layer
(:func:`fill_from_hf`, which ``train.init: canonical`` uses too). Checkpoints written by ``primus checkpoint import``
are DCP folders ``OUT/step_00000000`` holding the model only, loadable under any parallel layout
(``train.init_from=OUT``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from primus.core.config.schema import PrimusConfig
from primus.torchtitan import compat

compat.import_torchtitan()  # the CPU adaptations must precede torchtitan's first import
from primus.torchtitan.state_dict import _NOT_IN_HF, adapter  # noqa: E402  (the adapters, per family)

log = logging.getLogger("primus.torchtitan.hf")


def load_init_from(trainer: Any, cfg: PrimusConfig) -> None:
    """``train.init_from``: the model parts take the weights of a HF folder (checked to match the model; through
    the state-dict adapter, layer by layer) or of a torchtitan checkpoint of any layout (its model states, DCP)."""
    from primus.core.hf.contract import check_folder
    from primus.core.hf.safetensors_io import HFReader
    from primus.core.run.init_from import source
    from primus.torchtitan.checkpoint import load_model

    src = source(cfg.train.init_from)
    if src.kind == "checkpoint":
        load_model(trainer.checkpointer, src.path, cfg)
        return
    reader = HFReader(src.path)
    check_folder(cfg.model, reader, f"train.init_from {src.path}")
    n = fill_from_hf(trainer.model_parts, cfg, reader.get)
    log.info("initialised %d tensors from Hugging Face weights in %s", n, src.path)


def fill_from_hf(model_parts: list[torch.nn.Module], cfg: PrimusConfig, get: Any) -> int:
    """HF tensors (``get(hf_name)``, whole and fp32) into this rank's model parts, whatever their layout (FSDP /
    TP DTensors, pipeline stages): one layer at a time through the state-dict adapter, so no rank holds more than
    one layer's whole tensors. Returns the tensors filled."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from primus.core.hf.contract import EMBED, FINAL_NORM, LM_HEAD, layer_names

    m = cfg.model
    groups = [[EMBED, FINAL_NORM] + ([] if m.tie_word_embeddings else [LM_HEAD])]
    groups += [list(layer_names(m, i).values()) for i in range(m.num_layers)]
    ad = adapter(cfg)
    wanted = [set(part.state_dict()) for part in model_parts]
    options = StateDictOptions(full_state_dict=True, strict=False)
    # adapters of tied models look for the embedding in every call: hand it along, keep only the layer's keys
    embed = get(EMBED) if m.tie_word_embeddings else None
    filled = 0
    for i, names in enumerate(groups):
        tensors = {name: embed if name == EMBED and embed is not None else get(name) for name in names}
        if embed is not None:
            tensors.setdefault(EMBED, embed)
        converted = ad.from_hf(tensors)
        if i > 0:
            converted = {k: v for k, v in converted.items() if k.startswith("layers.")}
        for part, keys in zip(model_parts, wanted, strict=True):
            mine = {k: v for k, v in converted.items() if k in keys}
            if mine:
                set_model_state_dict(part, mine, options=options)
                filled += len(mine)
    return filled


def init_canonical(model_parts: list[torch.nn.Module], cfg: PrimusConfig) -> None:
    """``train.init: canonical``: core's initial tensors (:mod:`primus.core.run.initial_weights`, by HF name) into this rank's
    shards, so every layout, and the Megatron backend, starts from the same weights."""
    from primus.core.run import initial_weights as init

    n = fill_from_hf(model_parts, cfg, lambda name: init.tensor(name, cfg.model, cfg.train.seed))
    log.info("initialised %d tensors from train.seed %d (canonical init)", n, cfg.train.seed)


def build_model(cfg: PrimusConfig, device: str = "cpu") -> torch.nn.Module:
    """The single-device torchtitan model of ``cfg.model`` (fp32), unparallelised: for export and tests."""
    from primus.torchtitan.models import base_train_spec, model_args

    with torch.device(device):
        return base_train_spec(cfg.model).model_cls(model_args(cfg.model, cfg.train.seq_len))


def resolve_checkpoint(path: Path) -> Path:
    """A DCP checkpoint folder (``step-N``), or a folder holding some (the newest complete one)."""
    from primus.core.contracts.errors import UserError
    from primus.core.run import checkpoints
    from primus.torchtitan.checkpoint import NAMING

    if (path / ".metadata").is_file():
        return path
    found = checkpoints.latest(path, NAMING)  # complete ones only (manifest; never a partial .tmp)
    if found is None:
        raise UserError(f"{path} is neither a torchtitan checkpoint (no .metadata) nor a folder holding step-N ones")
    return found[1]


def load_model_state(cfg: PrimusConfig, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights (torchtitan names, whole tensors, fp32) of a checkpoint of any layout, one process."""
    import torch.distributed.checkpoint as dcp

    path = resolve_checkpoint(checkpoint)
    meta = build_model(cfg, device="meta")
    sd = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in meta.state_dict().items()}
    if cfg.model.tie_word_embeddings:
        sd.pop("output.weight", None)  # the same parameter as tok_embeddings.weight
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    if cfg.model.tie_word_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


class TorchtitanHF:
    """``BackendSpec.hf`` of the torchtitan backend (:class:`primus.core.hf.contract.HFInterop`)."""

    def import_hf(self, cfg: PrimusConfig, hf_dir: Path, out: Path) -> Path:
        """``OUT/step_00000000``: the model only, in DCP format. Start a run from it with ``train.init_from=OUT``."""
        import torch.distributed.checkpoint as dcp
        import yaml

        from primus.core.hf.contract import hf_names
        from primus.core.hf.safetensors_io import HFReader
        from primus.torchtitan.checkpoint import NAMING, save_one_process

        reader = HFReader(hf_dir)
        hf = {name: reader.get(name).float() for name in hf_names(cfg.model)}
        sd = adapter(cfg).from_hf(hf)
        if cfg.model.tie_word_embeddings:
            sd.pop("output.weight", None)  # saved once, as torchtitan saves a tied model
        meta = build_model(cfg, device="meta").state_dict()
        # loss-free balancing's routing bias: training state with no HF tensor, torchtitan's zeros to start from
        sd |= {k: torch.zeros(v.shape) for k, v in meta.items() if k.endswith(_NOT_IN_HF) and k not in sd}
        expected = set(meta) - ({"output.weight"} if cfg.model.tie_word_embeddings else set())
        if set(sd) != expected:
            raise RuntimeError(f"HF -> torchtitan names differ from the model's: {sorted(set(sd) ^ expected)[:6]}")
        target = NAMING.folder(out, 0)
        state = {k: v.contiguous() for k, v in sd.items()}
        save_one_process(target, cfg, lambda tmp: dcp.save(state, checkpoint_id=str(tmp), no_dist=True), str(hf_dir))
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        log.info("wrote %d tensors to %s", len(sd), target)
        return target

    def export_hf(self, cfg: PrimusConfig, checkpoint: Path) -> dict[str, Any]:
        sd = load_model_state(cfg, checkpoint)
        hf = adapter(cfg).to_hf(sd)
        if cfg.model.tie_word_embeddings:
            hf.pop("lm_head.weight", None)
        return {k: v.contiguous() for k, v in hf.items()}

    def export_adapters(self, cfg: PrimusConfig, checkpoint: Path) -> dict[str, torch.Tensor]:
        """A LoRA run's adapters (``cfg.train.lora``) from its checkpoint of any layout, HF-named, fp32, whole: held in
        PEFT's layout in the model (:mod:`primus.torchtitan.lora`), so only their names change."""
        import warnings

        import torch.distributed.checkpoint as dcp

        from primus.torchtitan.lora import checkpoint_keys

        keys = checkpoint_keys(cfg)
        sd = {key: torch.empty(shape, dtype=torch.float32) for key, (_, shape) in keys.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": whole tensors, as intended
            dcp.load(sd, checkpoint_id=str(resolve_checkpoint(checkpoint)), no_dist=True)
        return {name: sd[key] for key, (name, _) in keys.items()}


INTEROP = TorchtitanHF()
