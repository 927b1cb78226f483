"""Finds and loads libmla_torch.so, which registers torch.ops.mla.*."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import torch

_LIB_NAME = "libmla_torch.so"
_loaded_path: str | None = None


def _candidates() -> list[Path]:
    """Where the library may be, in order: $MLA_TORCH_LIBRARY, next to this package, and the
    repository's build folders (build-py*/) for an in-tree build, the most recently built
    first (so that a stale or CPU-only build-py/ does not shadow a fresh build elsewhere)."""
    found: list[Path] = []
    env = os.environ.get("MLA_TORCH_LIBRARY")
    if env:
        found.append(Path(env))
    here = Path(__file__).resolve().parent
    found.append(here / _LIB_NAME)
    repo_root = here.parent.parent
    builds = [Path(p) for p in glob.glob(str(repo_root / "build-py*" / _LIB_NAME))]
    found += sorted(builds, key=lambda p: (-_mtime(p), str(p)))
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed since the glob
        return 0.0


def load_library() -> str:
    """Loads the extension once; returns its path. Raises ImportError naming where it looked."""
    global _loaded_path
    if _loaded_path is not None:
        return _loaded_path
    env = os.environ.get("MLA_TORCH_LIBRARY")
    candidates = _candidates()
    for path in candidates:
        if path.is_file():
            torch.ops.load_library(str(path))
            _loaded_path = str(path)
            return _loaded_path
        if env and path == Path(env):
            raise ImportError(f"MLA_TORCH_LIBRARY={env} does not exist")
    looked = ", ".join(str(p) for p in candidates)
    raise ImportError(
        f"{_LIB_NAME} not found (looked at: {looked}). Build it with "
        "`cmake -S python -B build-py -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch; "
        "print(torch.utils.cmake_prefix_path)') && cmake --build build-py` "
        "or point MLA_TORCH_LIBRARY at it."
    )


def has_cuda_kernels() -> bool:
    """True when the loaded extension was built with the CUDA kernels."""
    load_library()
    return "cuda" in torch.ops.mla.build_info().split(",")
