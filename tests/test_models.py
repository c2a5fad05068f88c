import pytest
import torch

from adept_ext.models import SUPPORTED_ARCHITECTURES, adapter, load_model
from tiny_models import ARCHS, tiny_model


def test_embedded_default_loads_offline():
    model, tokenizer = load_model("smollm2-135m")
    ad = adapter(model)
    assert model.config.model_type == "llama" and ad.num_layers == 30 and ad.lm_head.weight.shape[0] == 49152
    assert getattr(model.config, "quantization_config", None) is None
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss < 8  # a trained model, not random weights (ln 49152 ≈ 10.8)


@pytest.mark.parametrize("arch", ARCHS)
def test_local_checkpoint_dir(arch, tmp_path):
    model = tiny_model(arch)
    model.save_pretrained(tmp_path)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<eos>": 1}, unk_token="a")),
                            eos_token="<eos>").save_pretrained(tmp_path)
    loaded, _ = load_model(tmp_path)
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
