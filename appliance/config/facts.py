"""A fact a checkpoint states about a config key, and how config values
are shown and compared against the checkpoint's (``config/checkpoint.py``,
the quantization registry's checkpoint readers, the loader)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fact:
    key: str  # config key, dotted below its section (e.g. "rope_scaling.factor" under model)
    value: Any
    source: str  # what the checkpoint says, e.g. "num_hidden_layers=2"


def shown(value: Any) -> str:
    """A config value as a user writes it (``true``, not ``True``)."""
    return json.dumps(value) if isinstance(value, (bool, list)) or value is None else str(value)


def same(a: Any, b: Any) -> bool:
    """Equal as config values; floats to 1e-6 (GGUF stores float32)."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b
