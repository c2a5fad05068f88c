"""Build of adept_ext: CPU kernels always, CUDA kernels when torch is a CUDA build and a
CUDA toolkit is found.

Environment:
  ADEPT_EXT_CUDA=0|1     0: CPU only; 1: CUDA required (error if it cannot be built);
                         unset: CUDA when possible.
  TORCH_CUDA_ARCH_LIST   GPU architectures (default 9.0: H100/H200).
  CUDA_HOME              toolkit root, if not in a standard place.
"""
import glob
import os
import platform
import shutil

from setuptools import find_packages, setup


def find_cuda_home():
    """A toolkit root that really holds the headers and libraries.

    nvcc on PATH may be a wrapper script (e.g. /usr/local/bin/nvcc), from which torch would
    guess CUDA_HOME=/usr/local and then fail to link (`cannot find -lcudart`).
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in candidates:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


want_cuda = os.environ.get("ADEPT_EXT_CUDA", "").strip()
if want_cuda not in ("", "0", "1"):
    raise SystemExit(f"ADEPT_EXT_CUDA must be 0 or 1, got {want_cuda!r}")
cuda_home = find_cuda_home() if want_cuda != "0" else None
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # before torch.utils.cpp_extension reads it
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

build_cuda = bool(cuda_home) and torch.version.cuda is not None and want_cuda != "0"
if want_cuda == "1" and not build_cuda:
    raise SystemExit(
        "ADEPT_EXT_CUDA=1 but CUDA kernels cannot be built: "
        f"torch.version.cuda={torch.version.cuda}, CUDA toolkit root={cuda_home}"
    )

# The CPU kernels use at::vec::Vectorized, whose width is chosen at compile time.
if platform.machine().lower() in ("x86_64", "amd64"):
    cpu_vec = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
else:
    cpu_vec = ["-DCPU_CAPABILITY=DEFAULT"]
# at::parallel_for is inline OpenMP code: without -fopenmp it silently runs on one thread.
# The soname libgomp.so.1 resolves to the copy torch has already loaded.
cxx_flags = ["-O3", "-fopenmp", *cpu_vec]
link_flags = ["-fopenmp"]

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
if build_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    ext = CUDAExtension(
        "adept_ext._C",
        sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        extra_link_args=link_flags,
    )
else:
    ext = CppExtension("adept_ext._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)

print(f"adept_ext: building CPU kernels{' and CUDA kernels (' + cuda_home + ')' if build_cuda else ''}")

setup(
    name="adept_ext",
    version="0.1.0",
    description="C++/CUDA kernels and tools for continual pretraining without forgetting (ADEPT and friends)",
    packages=find_packages(include=["adept_ext", "adept_ext.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch>=2.8", "numpy"],
    entry_points={"console_scripts": ["adept-ext = adept_ext.cli:main"]},
)
