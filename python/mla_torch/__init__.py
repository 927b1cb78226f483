"""mla_torch: the mla attention ops as torch.ops.mla.* and an MLA attention backend for Python
serving engines (see python/README.md)."""

from ._library import has_cuda_kernels, load_library

load_library()

from . import ops  # noqa: E402
from .backend import (  # noqa: E402
    AttentionLayer,
    DecodeMetadata,
    ForwardBatch,
    ForwardMode,
    LatentKvPool,
    MlaBackend,
    MlaMultiStepDraftBackend,
    PrefillMetadata,
    SpecInfo,
    mode_kind,
)

__all__ = [
    "AttentionLayer", "DecodeMetadata", "ForwardBatch", "ForwardMode", "LatentKvPool",
    "MlaBackend", "MlaMultiStepDraftBackend", "PrefillMetadata", "SpecInfo", "has_cuda_kernels",
    "load_library", "mode_kind", "ops",
]
