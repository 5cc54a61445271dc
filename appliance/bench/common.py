"""Results files and plots shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def machine_info() -> dict[str, Any]:
    from appliance.config.detect import cpu_info

    cpu = cpu_info()
    return {
        "platform": platform.platform(),
        "cpu": cpu.model,
        "cpu_isa": cpu.isa,  # the flags that decide what runs (appliance.config.detect.ISA_FLAGS)
        "cpu_fast_bf16": cpu.fast_bf16,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


@contextmanager
def counting_steps(engine: Any) -> Iterator[dict[str, int]]:
    """Count ``engine.step`` calls while the block runs (``counter["steps"]``, resettable)."""
    counter = {"steps": 0}
    orig = engine.step

    def counted():
        counter["steps"] += 1
        return orig()

    engine.step = counted
    try:
        yield counter
    finally:
        engine.step = orig


def write_results(out_dir: str, name: str, data: dict[str, Any]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    data = {"bench": name, "host": machine_info(), **data}  # "machine" is the roofline where a bench has one
    path.write_text(json.dumps(data, indent=2))
    return path


def plot_lines(out_dir: str, name: str, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
               logx: bool = False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(out_dir) / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(out_dir: str, name: str, title: str, values: dict[str, float], ylabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(values) + 2), 4.5))
    ax.bar(list(values), list(values.values()))
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right", rotation_mode="anchor")
    ax.grid(True, axis="y", alpha=0.3)
    path = Path(out_dir) / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def percentiles(xs: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (milliseconds in, milliseconds out)."""
    import numpy as np

    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(xs, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def server_under_test(base_url: str | None, overrides: list[str]) -> tuple[str, Any]:
    """The URL a load client sends to: ``base_url``, or a loopback `appliance run`
    started with ``overrides`` (returned second, for the caller to stop; else None)."""
    if base_url:
        return base_url.rstrip("/"), None
    from appliance.server.local import LocalServer

    own = LocalServer(overrides, ready_path="/ready")
    return own.url, own


def result_name(bench: str, label: str) -> str:
    """The results' file name (no suffix) of a server's run of ``bench`` labelled ``label``, as
    `appliance.bench.compare` reads it."""
    return f"{bench}-{label.replace('/', '_').replace(':', '_')}"


def split_overrides(parser, argv: list[str]):
    """argparse options plus Hydra overrides (the remaining key=value words)."""
    args, rest = parser.parse_known_args(argv)
    bad = [r for r in rest if "=" not in r or r.startswith("--")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    return args, rest


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """Token-id prompts (ids 100..vocab-1, avoiding special tokens at the low end)."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(100, vocab) for _ in range(max(1, lengths[i] - shared_prefix))] for i in range(n)]


def lengths_for(n: int, fixed: int, spread: str | None, seed: int = 0) -> list[int]:
    """``spread`` 'lo,hi' draws uniform lengths; else every length is ``fixed``."""
    import random

    if not spread:
        return [fixed] * n
    lo, hi = (int(x) for x in spread.split(","))
    rng = random.Random(seed + 1)
    return [rng.randint(lo, hi) for _ in range(n)]
