"""Which GPU architectures to build the CUDA kernels for, whether a build runs on a GPU, and which
torch versions a build supports.

Pure Python without torch, so that setup.py can load this file before the package is built
(it does so by path), `adept_ext/__init__.py` can check the torch before it loads the compiled
library, and the tests can check the decisions with fake capabilities and versions.

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

# What a build without a visible GPU targets: the data-centre and workstation cards users have
# (A100, A10/RTX 30xx/A6000, L4/L40/RTX 40xx, H100/H200), and PTX for later ones (Blackwell).
DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0+PTX"

# The torch versions (major.minor) adept_ext is tested with, lowest and highest: CI runs the whole
# suite on the highest, the GPU check (tools/gpu_check.sh) the CUDA tests on the lowest. The private
# torch APIs it uses are in adept_ext/ops/torch_internals.py, each checked on these versions.
TESTED_TORCH = ("2.11", "2.14")
UNTESTED_TORCH_ENV = "ADEPT_EXT_UNTESTED_TORCH"  # =1: let a torch outside TESTED_TORCH through

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


def major_minor(version: str) -> Tuple[int, int]:
    """(major, minor) of a version string such as "2.14.1+cu130" or "2.15.0.dev20260101"."""
    m = re.match(r"^\s*(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def torch_problem(torch_version: str, built_with: Optional[str] = None, allow_untested: bool = False) -> Optional[str]:
    """None when adept_ext can run with `torch_version`, else a one-line explanation with the fix.

    built_with: the torch version the compiled library was built against (None: not recorded).
    A torch outside TESTED_TORCH is refused unless `allow_untested`; a build against another
    major.minor than the running torch always is (the library links against torch's C++ ABI,
    which changes between minor versions).
    """
    low, high = (major_minor(v) for v in TESTED_TORCH)
    running = major_minor(torch_version)
    if not low <= running <= high and not allow_untested:
        return (f"adept_ext supports torch {TESTED_TORCH[0]} to {TESTED_TORCH[1]} (the versions it is tested with), "
                f"but torch {torch_version} is installed: install torch>={TESTED_TORCH[0]},<{high[0]}.{high[1] + 1} "
                f"and rebuild adept_ext against it, or set {UNTESTED_TORCH_ENV}=1 to try this torch at your own risk")
    if built_with is not None and major_minor(built_with) != running:
        return (f"adept_ext was built against torch {built_with} but torch {torch_version} is installed: rebuild it "
                "against this torch: pip install --no-build-isolation --no-deps --force-reinstall SOURCE "
                "(SOURCE: its source directory or sdist; docs/install.md)")
    return None
