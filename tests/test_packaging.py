"""setup.py states the Python the code really needs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDS = {r"^\s*import tomllib|^\s*from tomllib": (3, 11), r"zip\([^)]*strict=": (3, 10)}  # what the code uses


def test_python_requires_is_the_real_floor():
    floor = tuple(int(x) for x in re.search(r'python_requires=">=(\d+)\.(\d+)"',
                                            (ROOT / "setup.py").read_text()).groups())
    sources = "\n".join(p.read_text() for p in (ROOT / "adept_ext").rglob("*.py"))
    needed = max((version for pattern, version in NEEDS.items() if re.search(pattern, sources, flags=re.M)),
                 default=(3, 8))
    assert floor == needed, f"python_requires >= {floor} but the code needs {needed}"
