"""Where tokenflow keeps what it builds once per machine: the CPU attention kernel and the
compiled model steps (inductor's cache), so that a restart reuses them."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$TOKENFLOW_CACHE_DIR`, default `~/.cache/tokenflow`."""
    return Path(os.environ.get("TOKENFLOW_CACHE_DIR", Path.home() / ".cache" / "tokenflow"))
