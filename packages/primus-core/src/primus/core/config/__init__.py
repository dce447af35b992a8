"""Config: schema, YAML layering with provenance, validation."""

from primus.core.config.errors import ConfigError
from primus.core.config.schema import PrimusConfig

__all__ = ["ConfigError", "PrimusConfig"]
