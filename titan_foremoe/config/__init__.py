"""Typed job configuration: TOML files plus ``--section.key=value`` overrides."""

from .job_config import JobConfig
from .loader import ConfigError, load_config

__all__ = ["ConfigError", "JobConfig", "load_config"]
