"""Build torchfuse._C: one abi3 extension from csrc/ (glue) and kernels/ (C and CUDA compute).

Environment:
  TORCH_CUDA_ARCH_LIST  GPU architectures to build for; default: the local GPU's, else 9.0 (never all);
                        9.0 is built as 9.0a (Hopper's wgmma kernels included). An explicit "9.0" builds
                        without them (the mma.sync kernels run instead).
  TORCHFUSE_NO_CUDA=1   build the CPU paths only (also the default when no CUDA toolkit is found).
  CUDA_HOME             the CUDA toolkit; default: found from nvcc on PATH or /usr/local/cuda.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

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
        arch = f"{major}.{minor}"
    else:
        arch = "9.0"
    # 9.0a: Hopper with its arch-specific instructions (wgmma), which the HSTU forward uses; code built
    # for it runs on compute capability 9.0 only, as sm_90 code would on any GPU this build targets
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a" if arch == "9.0" else arch


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


with_cuda = (
    os.environ.get("TORCHFUSE_NO_CUDA") != "1" and CUDA_HOME is not None and torch.version.cuda is not None
)

cpu_sources = [s for s in _sources("csrc/*.cpp") if not s.endswith("_cuda.cpp")] + _sources("kernels/*.c")
cuda_sources = _sources("csrc/*_cuda.cpp") + _sources("kernels/*.cu")
extra_compile_args = {"cxx": ["-O3"]}


def _shared_libstdcxx_link_args():
    """Make the extension use the process's shared libstdc++ (the one torch loaded), never a copy of its own.

    A compiler that finds only libstdc++.a (e.g. the GPU image's CXX=/opt/gcc/bin/g++ wrapper: its
    `-print-file-name=libstdc++.so` finds nothing) links a private static libstdc++ into _C; with
    -Bsymbolic-functions (Debian/Ubuntu LDSHARED) our code then uses that copy's iostreams, whose
    locale facets are not the process's, and the first TORCH_CHECK message that formats a number
    segfaults in std::ostream::_M_insert<long>. Then link the loaded libstdc++.so.6 by path, ahead of
    the driver's implicit -lstdc++, so nothing is taken from the archive."""
    if not sys.platform.startswith("linux"):
        return []
    cxx = os.environ.get("CXX", "c++").split()
    try:
        found = subprocess.run(cxx + ["-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return []
    if os.path.isabs(found) and os.path.exists(found):
        return []  # the compiler links the shared runtime itself
    try:
        with open("/proc/self/maps") as f:  # torch is imported: its libstdc++.so.6 is mapped
            loaded = {line.split()[-1] for line in f if "/libstdc++.so" in line}
    except OSError:
        loaded = set()
    if not loaded:
        raise RuntimeError(f"{' '.join(cxx)} would link libstdc++ statically into torchfuse._C, and the shared "
                           "libstdc++ torch uses was not found; set CXX to a compiler that links it (e.g. /usr/bin/g++)")
    return [sorted(loaded)[0]]


extra_link_args = _shared_libstdcxx_link_args()

if with_cuda:
    _default_arch_list()
    extra_compile_args["nvcc"] = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    if any(a.split("+")[0] == "9.0a" for a in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")):
        extra_compile_args["nvcc"].append("-DTF_BUILT_SM90A")  # host code may dispatch to the sm_90a kernels
    ext = CUDAExtension(
        "torchfuse._C",
        cpu_sources + cuda_sources,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        define_macros=[("TORCHFUSE_WITH_CUDA", "1")],
        py_limited_api=True,
    )
else:
    ext = CppExtension(
        "torchfuse._C",
        cpu_sources,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        py_limited_api=True,
    )

setup(
    version=_version(),
    packages=find_packages("python"),  # torchfuse and its subpackages (hf, compat, selfcheck, recsys)
    package_dir={"": "python"},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
