"""What both loggers share: their settings under ``logging.loggers.<name>`` (checked when the config loads, naming
the key), the config flattened to dotted keys, the numeric metrics, and the run id kept in the run folder so that a
resumed run logs on to the same logger run."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from primus.core.config.errors import ConfigError
from primus.core.config.fields import suggest
from primus.core.contracts.protocols import ConfigIssue

log = logging.getLogger("primus.loggers")


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="log to it (false: named, yet off; e.g. turned off on the command line)")


class WandbSettings(Settings):
    project: str = Field("primus", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user (default: the API key's)")
    name: str | None = Field(None, description="run name (default: the run folder's name)")
    group: str | None = Field(None, description="W&B run group")
    tags: list[str] = Field(default_factory=list, description="W&B run tags")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="online, offline (files only, `wandb sync` later) or disabled (default: WANDB_MODE, else online)",
    )


class MlflowSettings(Settings):
    tracking_uri: str | None = Field(
        None,
        description="tracking server or store: http://host:5000, file:./mlruns, ... (default: MLFLOW_TRACKING_URI, "
        "else MLflow's own default)",
    )
    experiment: str = Field("primus", description="MLflow experiment (created when missing)")
    run_name: str | None = Field(None, description="run name (default: the run folder's name)")
    tags: dict[str, str] = Field(default_factory=dict, description="MLflow run tags")


def parse(name: str, model: type[Settings], section: dict[str, Any]) -> Settings:
    """``section`` as ``model``, or a :class:`ConfigError` naming each bad key under ``logging.loggers.<name>``."""
    try:
        return model.model_validate(section)
    except ValidationError as exc:
        issues = []
        for err in exc.errors():
            key = ".".join(["logging.loggers", name, *map(str, err["loc"])])
            if err["type"] == "extra_forbidden":
                hint = suggest(str(err["loc"][-1]), list(model.model_fields))
                message = "unknown key" + (f"; did you mean {hint!r}?" if hint else "")
                issues.append(ConfigIssue(key, message, allowed=", ".join(model.model_fields)))
            else:
                issues.append(ConfigIssue(key, err["msg"], value=err.get("input")))
        raise ConfigError(issues) from None


def check(name: str, config: dict[str, Any], model: type[Settings], library: str) -> None:
    """Refuse, naming the key, a logger named in the raw ``config`` with bad settings or without its library
    (``primus_configure``: before anything is built)."""
    loggers = (config.get("logging") or {}).get("loggers")
    section = loggers.get(name) if isinstance(loggers, dict) else None
    if not isinstance(section, dict):
        return  # absent: off; not a mapping: the schema refuses it
    if parse(name, model, section).enabled and importlib.util.find_spec(library) is None:
        raise ConfigError(
            [
                ConfigIssue(
                    f"logging.loggers.{name}",
                    f"turns the {name} logger on, but the {library} library is not installed",
                    allowed=f"pip install 'primus-loggers[{name}]', or remove logging.loggers.{name}",
                )
            ]
        )


def settings_of(config: Any, name: str, model: type[Settings]) -> Settings | None:
    """The settings of logger ``name`` in the validated config, or None when it is off."""
    section = config.logging.loggers.get(name)
    if section is None:
        return None
    settings = parse(name, model, section)
    return settings if settings.enabled else None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"steps": 8}}`` -> ``{"train.steps": 8}``; an empty mapping is kept as a value."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a logger records: the numbers of a ``metrics.jsonl`` row (as core's TensorBoard writer takes)."""
    return {key: value for key, value in metrics.items() if isinstance(value, (int, float))}


def _id_file(info: Any, name: str) -> Path:
    return Path(info.output_dir) / "loggers" / f"{name}.json"


def saved_run_id(info: Any, name: str) -> str | None:
    """The id of the logger run an earlier start in this run folder logged to (a resumed run logs on to it)."""
    try:
        return json.loads(_id_file(info, name).read_text())["run_id"]
    except (OSError, ValueError, KeyError):
        return None


def save_run_id(info: Any, name: str, run_id: str) -> None:
    path = _id_file(info, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run_id": run_id}) + "\n")


class Guard:
    """A logger that fails mid-run (a tracking server away) warns once and lets training go on."""

    def __init__(self, name: str) -> None:
        self.name, self.failures = name, 0

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self.failures += 1
        if self.failures == 1:
            log.warning("%s: logging failed (training goes on; later failures are counted): %s", self.name, exc)
        return True

    def report(self) -> None:
        if self.failures > 1:
            log.warning("%s: %d logging calls failed in this run", self.name, self.failures)
