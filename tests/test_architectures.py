"""Every supported architecture family end to end on a tiny random-weight config (the other
per-architecture checks — expansion, the probe, the fused loss, the lens, loading — are the
ARCHS-parametrised tests of test_expand, test_probe, test_lm_loss, test_lens and test_models),
and every refused architecture's error."""
import re

import pytest
import torch
from test_units import naive_unit_scores
from tiny_models import ARCHS, MOE, padded_batches, tiny_model
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import adept_ext
from adept_ext.errors import InputError
from adept_ext.methods import AdeptConfig, LlamaProConfig, LoraMethodConfig, SeqLoraConfig
from adept_ext.methods.lora import lora_adapters
from adept_ext.models import REFUSED_ARCHITECTURES, adapter, family_of, load_model
from adept_ext.adept.units import UnitImportance

METHODS = {"adept": AdeptConfig(k=1), "lora": LoraMethodConfig(rank=2), "llama_pro": LlamaProConfig(k=1),
           "seq_lora": SeqLoraConfig(rank=2)}


def attention_of(arch):
    return "sdpa" if "sdpa" in family_of(arch).attention else "eager"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_learns_and_the_model_reloads(arch, method, tmp_path):
    """adept, lora, llama_pro and seq_lora through `prepare`: the loss on the trained batch falls,
    the finished model is a plain one that `AutoModelForCausalLM.from_pretrained` reloads to the
    same logits, and LoRA adapts the family's projections (Phi-3's fused qkv_proj/gate_up_proj;
    in Qwen3-MoE and OLMoE PEFT also adapts the fused experts, in Mixtral it does not)."""
    model = tiny_model(arch).train()
    batches = padded_batches(n_batches=2)
    task = adept_ext.prepare(model, adept_ext.get_method(METHODS[method]), general_probe=batches, lr=1e-2,
                             total_steps=4, progress=False)
    if "lora" in method:  # in a mixture of experts PEFT adapts the attention and, where it maps them, the experts
        adapted = {name.rsplit(".", 1)[-1] for name, _ in lora_adapters(model)}
        want = set(family_of(arch).lora_targets)
        assert adapted >= {"q_proj", "k_proj", "v_proj", "o_proj"} if arch in MOE else adapted == want
    optimizer = torch.optim.AdamW(task.param_groups)
    task.attach(optimizer)
    losses = []
    for _ in range(4):
        loss = task.loss(batches[0])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    finished = task.finish().eval()
    finished.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=attention_of(arch)).eval()
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    batch = {k: v for k, v in batches[1].items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, finished(**batch).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_unit_importance_equals_plain_pytorch(arch):
    """On every family's expanded model the unit importance (scored on the source layers, as
    ADEPT does for fresh copies) equals plain PyTorch's per-unit mean of |θ ⊙ ∇θ|; in a mixture of
    experts the router is a unit of its own ("router") and the fused expert tensors are units."""
    model = tiny_model(arch)
    from adept_ext.adept.expand import expand_layers

    expand_layers(model, [0, 3])
    batches = padded_batches()
    importance = UnitImportance(model, batches)
    kinds = {u.name.split(".", 3)[-1]: u.kind for u in importance.units}
    if arch in MOE:
        assert kinds["mlp.gate.weight"] == "router" and kinds["mlp.experts.down_proj"] == "mlp"
    else:
        assert set(kinds.values()) == {"attention", "mlp", "norm"}
    names = [u.source_name for u in importance.units]
    torch.testing.assert_close(torch.tensor(importance.raw_scores(use_source=True), dtype=torch.float64),
                               torch.tensor(naive_unit_scores(model, batches, names, "abs"), dtype=torch.float64),
                               rtol=1e-4, atol=1e-9)


def refused_config(model_type):
    return CONFIG_MAPPING[model_type]()


@pytest.mark.parametrize("model_type", sorted(REFUSED_ARCHITECTURES))
def test_refused_architectures_name_why_before_loading(model_type, tmp_path):
    """A refused architecture's checkpoint is refused from its config.json alone, naming why."""
    refused_config(model_type).save_pretrained(tmp_path)
    reason = re.escape(f"unsupported architecture '{model_type}': {REFUSED_ARCHITECTURES[model_type]}")
    with pytest.raises(InputError, match=reason):
        load_model(tmp_path, attn_implementation="eager")


def test_a_refused_model_in_memory_is_refused_by_the_adapter():
    """A Qwen3.5 text model (Gated DeltaNet linear attention) built in memory: the adapter and
    `prepare` refuse it naming its layers, before anything changes."""
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_key_head_dim=8,
                               linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_conv_kernel_dim=4)
    model = AutoModelForCausalLM.from_config(config)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(InputError, match="'qwen3_5_text': its linear-attention layers"):
        adapter(model)
    with pytest.raises(InputError, match="its linear-attention layers"):
        adept_ext.prepare(model, adept_ext.get_method(AdeptConfig(k=1)), general_probe=padded_batches(),
                          lr=1e-3, total_steps=1, progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
