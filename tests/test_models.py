import json
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS, tiny_model

from adept_ext import models
from adept_ext.models import SUPPORTED_ARCHITECTURES, adapter, check_attention, family_of, load_model, resolve_attention


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


def test_embedded_conversion_names_the_model_and_shows_no_save_bar(tmp_path, monkeypatch, capsys, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(models.resolve_checkpoint("smollm2-135m"))
    tiny = tiny_model("llama")  # stands in for the dequantised GGUF model
    tiny.config._model_name_or_path = "Smollm2 135M 8k Lc100K Mix1 Ep2"  # what the GGUF metadata calls it
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: tiny)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    monkeypatch.setenv("ADEPT_EXT_CACHE", str(tmp_path / "cache"))
    with caplog.at_level("INFO", logger="adept_ext"):
        path = models.resolve_checkpoint("smollm2-135m")
    assert path == tmp_path / "cache" / "smollm2-135m"
    config = json.loads((path / "config.json").read_text())
    assert config["_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    err = capsys.readouterr().err
    assert "converting the embedded model smollm2-135m" in caplog.text and "Writing model shards" not in err
    assert hf_logging.is_progress_bar_enabled()
    tiny.save_pretrained(tmp_path / "plain")  # a user's own save still shows its bar (and capsys sees it)
    assert "Writing model shards" in capsys.readouterr().err


def save_tiny(arch, directory):
    """A tiny random `arch` model with a two-word tokenizer, saved as a checkpoint in `directory`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tiny_model(arch).save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "<eos>": 1}, unk_token="a")),
                            eos_token="<eos>").save_pretrained(directory)
    return Path(directory)


@pytest.mark.parametrize("arch", ARCHS)
def test_local_checkpoint_dir(arch, tmp_path):
    """The default backend, auto, is the one transformers picks for the model given none (eager for
    Gemma 2, sdpa elsewhere); an explicit sdpa is still refused for Gemma 2 before the weights load."""
    from transformers import AutoModelForCausalLM

    save_tiny(arch, tmp_path)
    loaded, _ = load_model(tmp_path)
    assert adapter(loaded).num_layers == 4 and loaded.config.model_type == arch
    picked = AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation  # transformers' own choice
    assert loaded.config._attn_implementation == picked == resolve_attention("auto", arch)
    if "sdpa" not in family_of(arch).attention:  # Gemma 2: transformers has no sdpa path
        with pytest.raises(ValueError, match=f"{arch} runs with --attn-implementation eager"):
            load_model(tmp_path, attn_implementation="sdpa")
    else:
        assert load_model(tmp_path, attn_implementation="eager")[0].config._attn_implementation == "eager"


def test_auto_passes_the_option_check():
    check_attention("auto")
    with pytest.raises(ValueError, match="must be one of sdpa, eager, flash_attention_2 or auto, got 'fast'"):
        check_attention("fast")


def test_hub_id_loads_from_the_local_cache_offline(tmp_path, monkeypatch):
    """`org/name` that is no local directory: its snapshot in the Hugging Face cache (the hub layout
    models--org--name/snapshots/<rev>, refs/main), never a download; one missing from the cache is a
    FileNotFoundError saying how to fetch it, and the cache is left as it was."""
    import socket

    from huggingface_hub import constants

    cache, revision = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny-org--tiny-llama"
    save_tiny("llama", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # huggingface_hub reads both at import
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    reached = []

    def no_network(*args, **kwargs):
        reached.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.chdir(tmp_path)
    model, tokenizer = load_model("tiny-org/tiny-llama")
    assert adapter(model).num_layers == 4 and model.config.name_or_path == "tiny-org/tiny-llama"
    assert tokenizer.eos_token == "<eos>"
    before = sorted(cache.rglob("*"))
    with pytest.raises(FileNotFoundError, match=r"'tiny-org/absent' is not a local directory.* local Hugging Face "
                                                r"cache .*never downloads: fetch it first with `hf download "
                                                r"tiny-org/absent`"):
        load_model("tiny-org/absent")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # not even asked to stay offline: still no download
    with pytest.raises(FileNotFoundError, match="hf download tiny-org/absent"):
        load_model("tiny-org/absent")
    assert sorted(cache.rglob("*")) == before and not reached
    save_tiny("qwen2", tmp_path / "tiny-org" / "tiny-llama")  # a local directory of that name comes first
    assert load_model("tiny-org/tiny-llama")[0].config.model_type == "qwen2"


def test_a_checkpoint_that_needs_trust_remote_code_is_refused(tmp_path):
    """A config.json whose auto_map names the checkpoint's own code (a model_type outside the
    family table, or another class than transformers' for a supported one) is refused in one line
    before anything loads; one that names transformers' own class (as Phi-3's checkpoints do) loads
    that class. The checkpoint's code never runs."""
    path = save_tiny("llama", tmp_path / "model")
    ran = tmp_path / "custom code ran"
    (path / "modeling_custom.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    config = json.loads((path / "config.json").read_text())
    refused = {"custom_llm": {"AutoConfig": "configuration_custom.CustomConfig",
                              "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"},
               "llama": {"AutoModelForCausalLM": "modeling_custom.MyLlamaForCausalLM"}}
    for model_type, auto_map in refused.items():
        (path / "config.json").write_text(json.dumps({**config, "model_type": model_type, "auto_map": auto_map}))
        with pytest.raises(ValueError, match=f"model_type '{model_type}' needs trust_remote_code .*modeling_custom"
                                             r"\.\w+ForCausalLM\), which adept_ext never runs") as e:
            load_model(path)
        assert "\n" not in str(e.value)
    own = {"AutoConfig": "configuration_custom.LlamaConfig", "AutoModelForCausalLM": "modeling_custom.LlamaForCausalLM"}
    (path / "config.json").write_text(json.dumps({**config, "auto_map": own}))
    model, _ = load_model(path)
    assert type(model).__module__ == "transformers.models.llama.modeling_llama"
    assert not ran.exists()


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

    monkeypatch.setattr(models.loading.os, "replace", other_process_wins)
    assert models.loading._embedded_checkpoint("smollm2-135m") == tmp_path / "smollm2-135m"
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m"]  # no temporary copy left behind


def test_a_model_larger_than_the_free_memory_is_refused_before_its_weights_are_read(tmp_path, monkeypatch, capsys):
    """`check_load_memory`: the bytes loaded in float32 or held (`loaded_bytes`, every parameter and
    buffer of the saved model, a tied weight once) against the device's free memory; a model that
    does not fit is refused in one line before transformers reads a weight, and `run` writes nothing."""
    from transformers import AutoModelForCausalLM

    from adept_ext.cli import main

    path = save_tiny("llama", tmp_path / "model")
    saved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    need = sum(t.numel() * 4 for t in [*saved.parameters(), *saved.buffers()])
    assert models.loaded_bytes(saved.config, torch.float32) == need
    assert models.loaded_bytes(saved.config, torch.bfloat16) == need // 2
    assert saved.config.dtype == torch.float32  # counted on a copy: the config still says how it is stored
    monkeypatch.setattr(models.loading, "free_memory", lambda device: need)
    assert load_model(path)[0].config.model_type == "llama"  # it just fits
    # held in bfloat16 from the load on (`run`): on the CPU beside the float32 values it rounds
    monkeypatch.setattr(models.loading, "free_memory", lambda device: need + need // 2)
    assert load_model(path, hold=torch.bfloat16)[0].config.model_type == "llama"
    monkeypatch.setattr(models.loading, "free_memory", lambda device: need + need // 2 - 1)
    with pytest.raises(ValueError, match=r"loaded \(bfloat16\) but cpu"):
        load_model(path, hold=torch.bfloat16)

    def no_read(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(models.loading, "free_memory", lambda device: need - 1)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_read)
    with pytest.raises(ValueError, match=r"the model takes 0\.0 GiB loaded \(float32\) but cpu has 0\.0 GiB free: "
                                         "use a device with more memory or a smaller model") as e:
        load_model(path)
    assert "\n" not in str(e.value)
    out = tmp_path / "out"
    assert main(["run", "--model", str(path), "--out", str(out), "--no-progress"]) == 2
    assert "GiB free: use a device with more memory" in capsys.readouterr().err
    assert not out.exists()
