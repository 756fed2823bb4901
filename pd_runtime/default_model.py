"""The model `pd-runtime serve`, `generate` and the planner's `profile` run when given none: the
bench-preset tiny model, generated once into the cache directory (PD_RUNTIME_CACHE).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-bench"


def default_cache_dir() -> Path:
    base = os.environ.get("PD_RUNTIME_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pd-runtime")
    return Path(base)


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The embedded default: the bench-preset tiny model, generated once on first use."""
    from pd_runtime.model.tiny import make_tiny_model

    path = (cache_dir or default_cache_dir()) / "models" / DEFAULT_MODEL_NAME
    if not (path / "model.safetensors").is_file():
        print(f"pd-runtime: generating the embedded default model into {path} ...",
              file=sys.stderr)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp, preset="bench")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            tmp.rename(path)
    return path
