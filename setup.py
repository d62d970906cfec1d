"""Build torchfuse._C: one abi3 extension from csrc/ (glue) and kernels/ (C and CUDA compute).

Environment:
  TORCH_CUDA_ARCH_LIST  GPU architectures to build for; default: the local GPU's, else 9.0 (never all).
  TORCHFUSE_NO_CUDA=1   build the CPU paths only (also the default when no CUDA toolkit is found).
  CUDA_HOME             the CUDA toolkit; default: found from nvcc on PATH or /usr/local/cuda.
"""
import glob
import os
import re
import shutil

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _find_cuda_home():
    """A toolkit directory with include/cuda_runtime.h, or None. Set before torch looks for one:
    torch otherwise guesses from nvcc's location, which is wrong when nvcc is a wrapper script."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "include", "cuda_runtime.h")):
            return c
    return None


if os.environ.get("TORCHFUSE_NO_CUDA") != "1":
    _home = _find_cuda_home()
    if _home:
        os.environ["CUDA_HOME"] = _home

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _version():
    with open(os.path.join(ROOT, "python", "torchfuse", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def _default_arch_list():
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    else:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


with_cuda = (
    os.environ.get("TORCHFUSE_NO_CUDA") != "1" and CUDA_HOME is not None and torch.version.cuda is not None
)

cpu_sources = [s for s in _sources("csrc/*.cpp") if not s.endswith("_cuda.cpp")] + _sources("kernels/*.c")
cuda_sources = _sources("csrc/*_cuda.cpp") + _sources("kernels/*.cu")
extra_compile_args = {"cxx": ["-O3"]}

if with_cuda:
    _default_arch_list()
    extra_compile_args["nvcc"] = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    ext = CUDAExtension(
        "torchfuse._C",
        cpu_sources + cuda_sources,
        extra_compile_args=extra_compile_args,
        define_macros=[("TORCHFUSE_WITH_CUDA", "1")],
        py_limited_api=True,
    )
else:
    ext = CppExtension("torchfuse._C", cpu_sources, extra_compile_args=extra_compile_args, py_limited_api=True)

setup(
    version=_version(),
    packages=["torchfuse"],
    package_dir={"": "python"},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
