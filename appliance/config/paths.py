"""Where the config tree lives: ``conf/`` in the repository, or
``$APPLIANCE_CONF_DIR``."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def conf_dir() -> Path:
    return Path(os.environ.get("APPLIANCE_CONF_DIR", REPO_ROOT / "conf")).resolve()
