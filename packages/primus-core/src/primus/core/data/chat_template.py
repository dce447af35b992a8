"""The chat template and special tokens of a tokenizer folder, where either ``transformers`` generation keeps them.

``transformers`` 5 saves the template as its own file, ``chat_template.jinja`` (named extra ones under
``additional_chat_templates/``), and no longer inside ``tokenizer_config.json``; 4.x kept it as that file's
``chat_template`` key (a string, or a list of named templates). Both are read, the file first, as ``transformers``
does. Nothing here imports more than the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JINJA = "chat_template.jinja"
EXTRA_TEMPLATES = "additional_chat_templates"
CONFIG = "tokenizer_config.json"


def folder_of(tokenizer_spec: str | Path) -> Path:
    """The folder of a tokenizer spec (a folder, or a ``tokenizer.json`` in one)."""
    path = Path(tokenizer_spec).expanduser()
    return path if path.is_dir() else path.parent


def tokenizer_config(folder: Path) -> dict[str, Any]:
    config = folder / CONFIG
    if not config.is_file():
        return {}
    try:
        data = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def chat_template(tokenizer_spec: str | Path) -> str | None:
    """The default chat template of the tokenizer folder (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``; a list of named templates gives its ``default`` one), or None where there is none."""
    if tokenizer_spec == "bundled":
        return None
    folder = folder_of(tokenizer_spec)
    if (folder / JINJA).is_file():
        return (folder / JINJA).read_text(encoding="utf-8")
    template = tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    return template if isinstance(template, str) else None


def special_tokens(tokenizer_spec: str | Path) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... of ``tokenizer_config.json`` (a template may name them); 4.x wrote some as
    ``{"content": ...}`` objects."""
    out = {}
    for key, value in tokenizer_config(folder_of(tokenizer_spec)).items():
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            value = value["content"]
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out
