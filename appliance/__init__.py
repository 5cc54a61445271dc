"""appliance: a declarative, configuration-driven LLM serving appliance."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import appliance` stays light for the CLI
    if name in ("LLM", "SamplingParams"):
        from appliance import entrypoint

        return getattr(entrypoint, name)
    raise AttributeError(name)
