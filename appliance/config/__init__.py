from appliance.config.compose import ConfigError, ResolvedConfig, resolve

__all__ = ["ConfigError", "ResolvedConfig", "resolve"]
