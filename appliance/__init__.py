"""appliance: a declarative, configuration-driven LLM serving appliance."""

from appliance.version import __version__

__all__ = ["__version__", "LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name):  # lazy: `import appliance` stays light for the CLI
    if name in ("LLM", "SamplingParams", "StructuredOutputsParams"):
        from appliance import entrypoint

        return getattr(entrypoint, name)
    raise AttributeError(name)
