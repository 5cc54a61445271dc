"""appliance: a declarative, configuration-driven LLM serving appliance."""

from appliance.version import __version__

__all__ = ["__version__", "LLM", "SamplingParams"]


def __getattr__(name):  # lazy: `import appliance` stays light for the CLI
    if name in ("LLM", "SamplingParams"):
        from appliance import entrypoint

        return getattr(entrypoint, name)
    raise AttributeError(name)
