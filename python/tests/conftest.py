"""pytest setup: the package from python/, the extension from $MLA_TORCH_LIBRARY or build-py*/.

Device parametrisation: tests taking the `device` fixture run on "cpu" always and on "cuda" when
a GPU is present and the extension has the CUDA kernels (else that case is skipped, saying why).
"""

import os
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import mla_torch  # noqa: E402


def cuda_ready() -> bool:
    return torch.cuda.is_available() and mla_torch.has_cuda_kernels()


def cuda_skip_reason() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return "the extension was built without CUDA"


requires_cuda = pytest.mark.skipif(not cuda_ready(), reason=cuda_skip_reason())


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not cuda_ready():
        pytest.skip(cuda_skip_reason())
    return torch.device(request.param)


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(1234)
    return g


def pytest_report_header(config):
    path = mla_torch.load_library()
    built = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(path)))
    return [f"mla_torch: {path} (built {built}, kernels: "
            f"{torch.ops.mla.build_info()}), torch {torch.__version__}, "
            f"cuda available: {torch.cuda.is_available()}"]
