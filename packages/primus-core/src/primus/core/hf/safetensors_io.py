"""Reading and writing HF checkpoint folders with the ``safetensors`` library (torch imported lazily).

A folder holds ``config.json`` and either ``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors``
listed in ``model.safetensors.index.json`` (``weight_map``: tensor name -> file). Reading is lazy: a tensor is
read from its file when asked for, so a rank that holds a slice of the model reads only what it needs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from primus.core.contracts.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Tokenizer files copied into an exported folder when they sit beside the run's tokenizer.json (the chat template
# as transformers 5 saves it: chat_template.jinja, named extra ones in a folder of their own).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
TOKENIZER_FOLDERS = ("additional_chat_templates",)


class HFCheckpointError(UserError):
    pass


class HFReader:
    """The tensors of a HF folder by name; ``get`` reads one (from whichever shard holds it)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise HFCheckpointError(f"{self.folder} is not a Hugging Face model folder: it has no config.json")
        self.config: dict[str, Any] = json.loads((self.folder / "config.json").read_text())
        index = self.folder / INDEX
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise HFCheckpointError(f"{self.folder} holds no *.safetensors weights")
            self.weight_map = {}
            for name in files:
                self.weight_map.update(dict.fromkeys(header_names(self.folder / name), name))
        self._open: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> Any:
        """The tensor ``name`` (a ``torch.Tensor`` on the CPU, in the file's dtype)."""
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.folder}: no tensor named {name!r} (the model has {len(self.weight_map)})")
        file = self.weight_map[name]
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(self.folder / file, framework="pt")
        return self._open[file].get_tensor(name)


def header_names(file: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header alone (8 bytes of length, then JSON): no torch."""
    import struct

    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (struct.error, ValueError) as exc:  # too short, or no JSON header
        raise HFCheckpointError(f"{file}: not a safetensors file ({exc})") from None
    return [k for k in header if k != "__metadata__"]


def _shards(tensors: Mapping[str, Any], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_hf(
    folder: str | Path,
    tensors: Mapping[str, Any],
    config: dict[str, Any],
    *,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer: str | Path | None = None,
) -> Path:
    """Write ``tensors`` (HF names -> CPU tensors) as safetensors shards + ``model.safetensors.index.json``,
    ``config.json``, and the tokenizer files found beside ``tokenizer`` (a tokenizer.json or its folder)."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        part = {n: tensors[n].detach().to("cpu").contiguous() for n in names}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        total += sum(t.numel() * t.element_size() for t in part.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        copy_tokenizer(tokenizer, out)
    return out


def copy_tokenizer(source: str | Path, out: Path) -> list[str]:
    """The tokenizer files beside ``source`` (a tokenizer.json or its folder) into ``out``. A chat template kept only
    in ``tokenizer_config.json`` (as transformers 4.x did) is written as ``chat_template.jinja`` too, as
    transformers 5 saves it (the key stays, for 4.x readers)."""
    from primus.core.data.chat_template import JINJA, chat_template

    src = Path(source)
    src = src if src.is_dir() else src.parent
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
            copied.append(name)
    for name in TOKENIZER_FOLDERS:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name, dirs_exist_ok=True)
            copied.append(name)
    if copied and not (out / JINJA).is_file() and (template := chat_template(src)) is not None:
        (out / JINJA).write_text(template, encoding="utf-8")
        copied.append(JINJA)
    if copied and not (out / "tokenizer_config.json").is_file():
        # transformers needs the class to build a fast tokenizer from tokenizer.json alone
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return copied


def missing(reader: HFReader, expected: Iterable[str]) -> list[str]:
    return [n for n in expected if n not in reader]


def folder_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is not a HF model folder (for config validation, without reading weights), or None."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return f"no such folder: {path}"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json (not a Hugging Face model folder)"
    if not (path / INDEX).is_file() and not any(path.glob("*.safetensors")):
        return f"{path} holds no *.safetensors weights"
    return None
