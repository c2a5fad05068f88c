import json
from pathlib import Path

import pytest
import torch

from adept_ext import models
from adept_ext.models import SUPPORTED_ARCHITECTURES, adapter, family_of, load_model
from tiny_models import ARCHS, tiny_model


def test_embedded_default_loads_offline():
    model, tokenizer = load_model("smollm2-135m")
    ad = adapter(model)
    assert model.config.model_type == "llama" and ad.num_layers == 30 and ad.lm_head.weight.shape[0] == 49152
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config._model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"  # not the GGUF's internal name
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss < 8  # a trained model, not random weights (ln 49152 ≈ 10.8)


def test_embedded_conversion_names_the_model_and_shows_no_save_bar(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(models.resolve_checkpoint("smollm2-135m"))
    tiny = tiny_model("llama")  # stands in for the dequantised GGUF model
    tiny.config._model_name_or_path = "Smollm2 135M 8k Lc100K Mix1 Ep2"  # what the GGUF metadata calls it
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: tiny)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    monkeypatch.setenv("ADEPT_EXT_CACHE", str(tmp_path / "cache"))
    path = models.resolve_checkpoint("smollm2-135m")
    assert path == tmp_path / "cache" / "smollm2-135m"
    config = json.loads((path / "config.json").read_text())
    assert config["_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    err = capsys.readouterr().err
    assert "converting the embedded model smollm2-135m" in err and "Writing model shards" not in err
    assert hf_logging.is_progress_bar_enabled()
    tiny.save_pretrained(tmp_path / "plain")  # a user's own save still shows its bar (and capsys sees it)
    assert "Writing model shards" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHS)
def test_local_checkpoint_dir(arch, tmp_path):
    model = tiny_model(arch)
    model.save_pretrained(tmp_path)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<eos>": 1}, unk_token="a")),
                            eos_token="<eos>").save_pretrained(tmp_path)
    attention = family_of(arch).attention
    if "sdpa" not in attention:  # Gemma 2: transformers has no sdpa path; refused before the weights load
        with pytest.raises(ValueError, match=f"{arch} runs with --attn-implementation eager"):
            load_model(tmp_path)
    loaded, _ = load_model(tmp_path, attn_implementation="sdpa" if "sdpa" in attention else "eager")
    assert adapter(loaded).num_layers == 4 and loaded.config.model_type == arch


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an embedded model"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="supported: " + ", ".join(SUPPORTED_ARCHITECTURES)):
        adapter(torch.nn.Linear(2, 2))
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(tmp_path)


def test_a_concurrent_conversion_of_the_embedded_model_is_not_an_error(tmp_path, monkeypatch):
    """Two processes converting the embedded model at once (a fresh machine, parallel jobs): the
    one that renames second finds the other's complete copy and uses it (it used to raise
    'Directory not empty')."""
    import os

    from adept_ext import models

    monkeypatch.setenv("ADEPT_EXT_CACHE", str(tmp_path))
    replace = os.replace

    def other_process_wins(src, dst):
        Path(dst).mkdir()
        (Path(dst) / "config.json").write_text("{}")  # the other process's finished copy
        replace(src, dst)

    monkeypatch.setattr(models.os, "replace", other_process_wins)
    assert models._embedded_checkpoint("smollm2-135m") == tmp_path / "smollm2-135m"
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m"]  # no temporary copy left behind
