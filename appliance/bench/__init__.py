"""`appliance bench <kind>`: benchmarks that write JSON results and a PNG plot."""

from __future__ import annotations

import importlib

KINDS = {
    "scheduler": "appliance.bench.scheduler",
    "machine": "appliance.bench.machine",
    "gemm": "appliance.bench.gemm",
    "throughput": "appliance.bench.throughput",
    "serve": "appliance.bench.serve",
    "apis": "appliance.bench.apis",
    "beams": "appliance.bench.beams",
    "latency": "appliance.bench.latency",
    "long-context": "appliance.bench.long_context",
    "mix": "appliance.bench.mix",
    "prefix": "appliance.bench.prefix",
    "spec": "appliance.bench.spec",
    "structured": "appliance.bench.structured",
    "parallel": "appliance.bench.parallel",
    "moe": "appliance.bench.moe",
    "mxfp4": "appliance.bench.mxfp4",
    "perplexity": "appliance.bench.perplexity",
    "offload": "appliance.bench.offload",
    "pd": "appliance.bench.pd",
}


def main(kind: str, argv: list[str]) -> int:
    if kind not in KINDS:
        from appliance.config.compose import ConfigError

        raise ConfigError(f"unknown bench kind {kind!r}; available: {', '.join(sorted(KINDS))}")
    return importlib.import_module(KINDS[kind]).main(argv)
