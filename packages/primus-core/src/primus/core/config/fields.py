"""Walk the schema by dotted key: field descriptions, annotations, command-line value coercion."""

from __future__ import annotations

import difflib
from typing import Any, get_args

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from primus.core.config.schema import PrimusConfig


def section_model(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def field_info(dotted: str, root: type[BaseModel] = PrimusConfig) -> FieldInfo | None:
    """The pydantic field at ``dotted`` (``"train.optimizer.lr"``), or None if there is none."""
    model: type[BaseModel] | None = root
    info: FieldInfo | None = None
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = section_model(info.annotation)
    return info


def coerce(dotted: str, value: Any) -> Any:
    """Convert a command-line value to its field's type where that is unambiguous ("8" -> 8). ``true`` / ``false``
    never become a number (pydantic's lax mode reads True as 1): they stay as they are, and the strict
    validation refuses them for an int or float field, naming the key, as it does in a YAML file."""
    info = field_info(dotted)
    if info is None or info.annotation is None or section_model(info.annotation) is not None:
        return value
    adapter = TypeAdapter(info.annotation)
    try:
        return adapter.validate_python(value, strict=True)
    except ValidationError:
        if isinstance(value, bool):
            return value
    try:
        return adapter.validate_python(value, strict=False)
    except ValidationError:
        return value  # strict validation reports it, naming the key


def suggest(name: str, choices: list[str]) -> str | None:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def describe(dotted: str) -> str:
    info = field_info(dotted)
    return (info.description or "") if info else ""
