"""Errors a user can fix (printed without a traceback). Dependency-free, so
kernel modules can raise them on machines without the config stack."""


class ConfigError(Exception):
    """A config or deployment problem a user can fix."""


class ModelLoadError(ConfigError):
    """A model's weights that cannot load as configured (a missing, mismatched or unreadable checkpoint)."""
