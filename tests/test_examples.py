"""The documentation's Python code runs as written: the ```python blocks of README.md, and of
docs/api.md, each page in order as one session.

`load_model("smollm2-135m")` is replaced by a tiny random Llama with the real SmolLM2 tokenizer,
so the blocks run in seconds; everything else (data, probe, expansion, training loop,
projection, diagnostics, kernels) is the real code the README shows.
"""
import re
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from adept_ext import models

ROOT = Path(__file__).resolve().parents[1]
README, API = ROOT / "README.md", ROOT / "docs" / "api.md"


def python_blocks(markdown: str):
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


@pytest.fixture
def tiny_embedded_model(monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(models.resolve_checkpoint("smollm2-135m"))

    def load_model(name_or_dir, dtype=torch.float32, device="cpu"):
        assert name_or_dir == "smollm2-135m", name_or_dir
        return tiny_model("llama", layers=6, vocab=len(tokenizer)), tokenizer

    monkeypatch.setattr(models, "load_model", load_model)


def test_python_blocks_are_found():
    blocks = python_blocks("text\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a\n```\n")
    assert blocks == ["a = 1\n", "b = a\n"]


def run_blocks(page: Path, session: dict):
    for i, code in enumerate(python_blocks(page.read_text()), 1):
        try:
            exec(compile(code, f"{page.name} python block {i}", "exec"), session)
        except Exception as e:  # noqa: BLE001 — name the block, not only the line
            pytest.fail(f"{page.name} python block {i} does not run: {type(e).__name__}: {e}\n{code}")
    return session


def test_readme_quickstart_runs_as_written(tmp_path, monkeypatch, tiny_embedded_model):
    monkeypatch.chdir(tmp_path)
    session = run_blocks(README, {"__name__": "__readme__"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adapted")
    assert reloaded.config.num_hidden_layers == 6 + 4  # ADEPT's k = 4 copies, saved as a plain HF model
    assert reloaded.config.adept["expanded_layers"] == session["model"].config.adept["expanded_layers"]


def test_api_python_blocks_run_as_written(tmp_path, monkeypatch, tiny_embedded_model):
    assert len(python_blocks(API.read_text())) >= 6, "docs/api.md has lost its Python examples"
    monkeypatch.chdir(tmp_path)  # the blocks write layers.json, expanded/, diagnosis.png, ...
    session = run_blocks(API, {"__name__": "__api__"})
    # The blocks did what their comments say.
    assert (tmp_path / "layers.png").exists() and (tmp_path / "diagnosis.json").exists()
    assert (tmp_path / "expanded" / "config.json").exists()
    assert session["scores"].selected == session["chosen"] and len(session["rates"]) > 0
    assert session["loss"].shape == (512,)
