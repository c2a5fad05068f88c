"""Which GPU architectures to build the CUDA kernels for, and whether a build runs on a GPU.

Pure Python without torch, so that setup.py can load this file before the package is built
(it does so by path) and the tests can check the decisions with fake capabilities.

An entry of a TORCH_CUDA_ARCH_LIST is ``M.m`` (machine code, SASS, for sm_Mm), optionally with
an ``a`` (arch-specific, e.g. ``9.0a``) or ``f`` (family) suffix and ``+PTX`` (also PTX for
compute_Mm); entries are separated by ``;``, spaces or commas; torch's names (``Hopper``...) are
accepted. CUDA's compatibility rules (CUDA C++ Programming Guide, "Binary Compatibility" and
"PTX Compatibility"): SASS for sm_Mm runs on a GPU of capability M.n with n ≥ m (same major);
an ``a`` SASS only on exactly M.m; PTX for compute_Mm is JIT-compiled on any capability ≥ M.m
(except an ``a`` PTX, which is not forward compatible).
"""
import re
from typing import List, NamedTuple, Optional, Sequence, Tuple

DEFAULT_ARCH_LIST = "9.0"  # H100/H200: what a build without a visible GPU targets

# torch.utils.cpp_extension's names (combined names first, as there).
NAMED_ARCHES = (
    ("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"), ("Rubin", "10.7+PTX"),
)

_ENTRY = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


class Arch(NamedTuple):
    major: int
    minor: int
    suffix: str  # "", "a" or "f"
    ptx: bool


def parse_arch_list(arch_list: str) -> List[Arch]:
    """The entries of a TORCH_CUDA_ARCH_LIST string; raises ValueError on an unknown entry."""
    text = arch_list
    for name, value in NAMED_ARCHES:
        text = text.replace(name, value)
    archs = []
    for entry in filter(None, re.split(r"[;,\s]+", text)):
        m = _ENTRY.match(entry)
        if not m:
            raise ValueError(f"unknown CUDA architecture {entry!r} in TORCH_CUDA_ARCH_LIST={arch_list!r}")
        archs.append(Arch(int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4))))
    return archs


def choose_arch_list(env_value: Optional[str], capabilities: Sequence[Tuple[int, int]],
                     max_supported: Optional[Tuple[int, int]] = None) -> str:
    """The TORCH_CUDA_ARCH_LIST to build with.

    env_value: the user's TORCH_CUDA_ARCH_LIST (respected as given unless empty or "native");
    capabilities: (major, minor) of every visible GPU; max_supported: the highest capability
    the toolchain supports (torch clamps to it the same way). With no setting and a visible
    GPU: every visible GPU's architecture, the highest also as PTX (what torch's own detection
    does); with neither: DEFAULT_ARCH_LIST.
    """
    if env_value and env_value.strip() and env_value.strip() != "native":
        return env_value.strip()
    caps = sorted({min(tuple(c), tuple(max_supported)) if max_supported else tuple(c) for c in capabilities})
    if not caps:
        return DEFAULT_ARCH_LIST
    names = [f"{major}.{minor}" for major, minor in caps]
    names[-1] += "+PTX"
    return ";".join(names)


def runs_on(arch_list: str, capability: Tuple[int, int]) -> bool:
    """Whether a build for `arch_list` has code that a GPU of `capability` can run."""
    major, minor = capability
    for a in parse_arch_list(arch_list):
        if a.suffix == "a":
            if (a.major, a.minor) == (major, minor):
                return True
            continue
        if a.major == major and minor >= a.minor:
            return True
        if a.ptx and (major, minor) >= (a.major, a.minor):
            return True
    return False


def mismatch_message(arch_list: str, capability: Tuple[int, int], device_name: str = "the GPU") -> Optional[str]:
    """None when the build runs on the GPU, else an explanation with the fix."""
    if runs_on(arch_list, capability):
        return None
    cap = f"{capability[0]}.{capability[1]}"
    return (f"adept_ext's CUDA kernels were built for TORCH_CUDA_ARCH_LIST={arch_list!r}, which cannot run on "
            f"{device_name} (compute capability {cap}). Rebuild on this machine (the build then targets the "
            f"visible GPU), or with TORCH_CUDA_ARCH_LIST='{cap}+PTX': "
            "ADEPT_EXT_CUDA=1 python setup.py build_ext --inplace")
