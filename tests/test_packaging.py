"""Packaging: the metadata states the Python and torch the code really needs, `import adept_ext`
refuses a torch it cannot run with (one line, before the compiled library loads), and the built
wheel works in a fresh virtual environment with nothing but torch and what the metadata declares."""
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import adept_ext
from adept_ext import _cuda_arch

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NEEDS = {r"^\s*import tomllib|^\s*from tomllib": (3, 11), r"zip\([^)]*strict=": (3, 10)}  # what the code uses


def test_python_requires_is_the_real_floor():
    floor = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", PROJECT["requires-python"]).groups())
    sources = "\n".join(p.read_text() for p in (ROOT / "adept_ext").rglob("*.py"))
    needed = max((version for pattern, version in NEEDS.items() if re.search(pattern, sources, flags=re.M)),
                 default=(3, 8))
    assert floor == needed, f"requires-python >= {floor} but the code needs {needed}"


def test_version_is_the_metadata_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", adept_ext.__version__)
    assert importlib.metadata.version("adept_ext") == adept_ext.__version__  # the editable install's metadata


def test_this_build_records_the_torch_it_was_built_against():
    from adept_ext import _build_info

    assert _cuda_arch.major_minor(_build_info.TORCH_VERSION) == _cuda_arch.major_minor(torch.__version__)


def _import_in_subprocess(setup: str):
    """`import adept_ext` in a fresh interpreter after `setup` (Python code) ran: its stderr's last line."""
    code = f"import sys, types, torch\n{setup}\nimport adept_ext\nprint('imported')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != _cuda_arch.UNTESTED_TORCH_ENV})
    return proc.returncode, proc.stdout, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


@pytest.mark.parametrize("version", ["2.10.2", "2.15.0", "3.0.0"])
def test_import_refuses_a_torch_outside_the_tested_range(version):
    rc, out, last = _import_in_subprocess(f"torch.__version__ = {version!r}")
    assert rc != 0 and "imported" not in out
    assert last == ("ImportError: " + _cuda_arch.torch_problem(version))
    assert "supports torch 2.11 to 2.14" in last and f"torch {version} is installed" in last


def test_import_refuses_a_build_against_another_torch():
    built = "2.11.0+cu130" if _cuda_arch.major_minor(torch.__version__) != (2, 11) else "2.14.1"
    rc, out, last = _import_in_subprocess(
        f"sys.modules['adept_ext._build_info'] = types.SimpleNamespace(TORCH_VERSION={built!r}, CUDA_ARCH_LIST=None)")
    assert rc != 0 and "imported" not in out
    assert re.fullmatch(rf"ImportError: adept_ext was built against torch {re.escape(built)} but torch "
                        rf"{re.escape(torch.__version__)} is installed: rebuild it .*", last)


def test_import_accepts_an_untested_torch_when_asked(monkeypatch):
    from adept_ext import _build_info

    monkeypatch.setattr(torch, "__version__", "2.15.0")
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "2.15.0", raising=False)  # built against it
    with pytest.raises(ImportError, match="supports torch 2.11 to 2.14"):
        adept_ext._refuse_unsupported_torch()
    monkeypatch.setenv(_cuda_arch.UNTESTED_TORCH_ENV, "1")
    adept_ext._refuse_unsupported_torch()
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "2.14.1")
    with pytest.raises(ImportError, match="built against torch 2.14.1"):  # never a build against another torch
        adept_ext._refuse_unsupported_torch()


def test_a_build_that_predates_the_record_is_let_through(monkeypatch):
    from adept_ext import _build_info

    monkeypatch.delattr(_build_info, "TORCH_VERSION", raising=False)
    adept_ext._refuse_unsupported_torch()


@pytest.fixture
def cpu_only_build(monkeypatch):
    monkeypatch.setattr(adept_ext, "has_kernel", lambda op, key: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")


def test_cpu_only_build_says_so_when_a_gpu_is_visible(cpu_only_build, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning) as record:
        adept_ext._notice_cpu_only_build()
    assert len(record) == 1 and "built with CPU kernels only" in str(record[0].message)
    assert "\n" not in str(record[0].message)


def test_cpu_only_build_is_silent_without_a_gpu(cpu_only_build, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adept_ext._notice_cpu_only_build()


# ---- the wheel in a fresh virtual environment -------------------------------------------------

def _torch_closure():
    """Canonical names of torch and every distribution it requires, recursively (with the extras
    asked for, markers evaluated here), except the installers, which the new environment has."""
    seen, todo = {}, [("torch", frozenset())]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key]:
            continue
        seen[key] = seen.get(key, frozenset()) | extras
        for line in importlib.metadata.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (seen[key] or {""})):
                todo.append((req.name, frozenset(req.extras)))
    return sorted(set(seen) - {"pip", "setuptools", "wheel"})


def _expose_torch_only(venv: Path, links: Path):
    """Make this environment's torch (the lock's) importable in `venv` and nothing else of it: a folder
    of links to the files of torch and its own dependencies, named by one .pth line. Installing torch
    with its CUDA libraries would download and unpack some GB per run; the links take a second. pip
    sees these distributions as installed (and never uninstalls them: they are outside `venv`)."""
    links.mkdir()
    for name in _torch_closure():
        dist = importlib.metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files}:
            if top not in ("..", "__pycache__") and not top.endswith(".pth") and not (links / top).exists():
                (links / top).symlink_to(dist.locate_file(top))
    site = subprocess.check_output([venv / "bin" / "python", "-c",
                                    "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    Path(site, "torch-only.pth").write_text(f"{links}\n")


def _run(cmd, cwd, timeout, **env):
    """Run `cmd` with this environment less PYTHONPATH (so only the new environment's packages count)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", _cuda_arch.UNTESTED_TORCH_ENV)}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**environ, **env})
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The CPU-only wheel, built from a copy of the sources (the in-place build's adept_ext/_C*.so and
    _build_info.py stay as they are) against this environment's torch, as docs/install.md says."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "csrc", src / "csrc")
    shutil.copytree(ROOT / "adept_ext", src / "adept_ext",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_info.py"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", dist, src], src,
         timeout=900, ADEPT_EXT_CUDA="0")
    (whl,) = dist.glob("adept_ext-*.whl")
    return whl


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel):
    """A new virtual environment holding torch alone (this environment's, which is the lock's), then the
    wheel installed into it: everything else comes from the wheel's metadata (at the lock's versions)."""
    lock = {canonicalize_name(r.name): r for r in map(Requirement, filter(None, (
        line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines())))}
    assert lock["torch"].specifier.contains(torch.__version__), \
        f"this environment's torch {torch.__version__} is not the lock's {lock['torch']}: run make setup"
    base = tmp_path_factory.mktemp("venv")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", venv], base, timeout=300)
    _expose_torch_only(venv, base / "torch-only")
    python = venv / "bin" / "python"
    listed = json.loads(_run([python, "-m", "pip", "list", "--format", "json"], base, timeout=120).stdout)
    assert {canonicalize_name(p["name"]) for p in listed} - {"pip", "setuptools"} == set(_torch_closure())
    _run([python, "-m", "pip", "install", "-c", ROOT / "requirements.txt", wheel], base, timeout=900)
    return venv


def test_wheel_works_in_a_fresh_environment(fresh_venv, tmp_path):
    from tiny_models import write_run_workspace  # a tiny Llama with a saved tokenizer, and local corpora

    bin_dir = fresh_venv / "bin"
    assert "adept-ext run" in _run([bin_dir / "adept-ext", "--help"], tmp_path, timeout=300).stdout
    proc = _run([bin_dir / "python", "-c", "import adept_ext, importlib.metadata; adept_ext.prepare; "
                 "from adept_ext import _build_info as b; print(adept_ext.__file__, adept_ext.__version__, "
                 "importlib.metadata.version('adept_ext'), b.TORCH_VERSION, b.CUDA_ARCH_LIST)"],
                tmp_path, timeout=300)
    where, version, metadata_version, built_with, arch_list = proc.stdout.split()
    assert Path(where).is_relative_to(fresh_venv) and version == metadata_version == adept_ext.__version__
    assert built_with == torch.__version__ and arch_list == "None"  # the build's record: this torch, CPU only
    assert proc.stderr == ""  # no notice: no GPU is visible (a CPU-only build says so only next to one)

    ws = write_run_workspace(tmp_path / "ws")
    _run([bin_dir / "adept-ext", "run", "--model", ws / "tiny", "--general", ws / "general",
          "--domain", ws / "domain.jsonl", "--out", ws / "out", "--steps", "2", "--device", "cpu", "--no-progress",
          "--block-len", "32", "--batch-size", "2", "--probe-blocks", "2", "--eval-blocks", "2", "--k", "2",
          "--warmup-steps", "1", "--eval-every", "2", "--save-every", "0"], tmp_path, timeout=600,
         HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"), MPLCONFIGDIR=str(tmp_path / "mpl"))
    report = json.loads((ws / "out" / "report.json").read_text())
    assert report["method"] == "adept" and (ws / "out" / "model" / "config.json").exists()
    assert len(report["history"]["train"]) == 2
