import pytest
import torch
from tiny_models import ARCHS, padded_batches, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from adept_ext.adept.expand import expand_layers, select_layers
from adept_ext.models import adapter
from adept_ext.adept.probe import layer_importance


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_expansion_preserves_function_and_bookkeeping(arch, tmp_path):
    model = tiny_model(arch, layers=4)
    batch = padded_batches(n_batches=1)[0]
    before = logits(model, batch)
    types_before = list(getattr(model.config, "layer_types", []) or [])
    trainable = expand_layers(model, [0, 2])
    assert model.config.num_hidden_layers == 6 and len(model.model.layers) == 6
    adept = model.config.adept
    assert adept["expanded_layers"] == [1, 4] and adept["source_layers"] == [0, 3]
    assert adept["source_layers_before_expansion"] == [0, 2]
    assert [l.self_attn.layer_idx for l in model.model.layers] == list(range(6))
    if types_before:
        assert model.config.layer_types == ([types_before[0]] * 2 + [types_before[1]]
                                            + [types_before[2]] * 2 + [types_before[3]])
    if arch == "qwen2":  # layers >= max_window_layers slide: the threshold moves with the inserted copy of layer 0
        assert model.config.max_window_layers == 3
    if arch == "smollm3":  # which layers use RoPE: the copies' entries beside their sources'
        assert len(model.config.no_rope_layers) == 6
    if arch == "qwen3_moe":  # layer 2 was dense: now layer 3, and its copy (layer 4) is dense too
        assert model.config.mlp_only_layers == [3, 4]
        assert hasattr(model.model.layers[4].mlp, "down_proj") and hasattr(model.model.layers[1].mlp, "experts")
    # copies: own storage, zeroed residual outputs (o_proj, down_proj or every expert's); everything else frozen
    copy, source = model.model.layers[1], model.model.layers[0]
    zeroed = adapter(model).residual_outputs(copy)
    assert zeroed and all((t == 0).all() for t in zeroed)
    assert not all((t == 0).all() for t in adapter(model).residual_outputs(source))
    kept, src = [(n, p) for n, p in copy.named_parameters() if all(p is not t for t in zeroed)], \
        dict(source.named_parameters())
    assert kept and all(torch.equal(p, src[n]) and p.data_ptr() != src[n].data_ptr() for n, p in kept)
    ids = {id(p) for p in trainable}
    assert ids == {id(p) for i in (1, 4) for p in model.model.layers[i].parameters()}
    assert all(p.requires_grad == (id(p) in ids) for p in model.parameters())
    assert (logits(model, batch) - before).abs().max() <= 1e-6

    # save with plain transformers, reload with no custom code
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.adept == model.config.adept and reloaded.config.num_hidden_layers == 6
    assert (logits(reloaded, batch) - before).abs().max() <= 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_with_kv_cache_is_unchanged(arch):
    model = tiny_model(arch, layers=3)
    prompt = torch.tensor([[5, 9, 13, 2]])
    want = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    expand_layers(model, [1, 2])
    got = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(got, want)


def test_expanding_twice_keeps_bookkeeping():
    model = tiny_model("qwen3", layers=4)
    batch = padded_batches(n_batches=1)[0]
    before = logits(model, batch)
    expand_layers(model, [1])           # copy at 2 of source 1
    trainable = expand_layers(model, [0, 3])  # indices of the expanded model: copy of 0 at 1, of 3 at 5
    adept = model.config.adept
    assert adept["expanded_layers"] == [1, 3, 5] and adept["source_layers"] == [0, 2, 4]
    assert adept["source_layers_before_expansion"] == [0, 1, 2]  # copies of the original layers 0, 1 and 2
    assert len(trainable) == 3 * len(list(model.model.layers[0].parameters()))
    assert (logits(model, batch) - before).abs().max() <= 1e-6


def test_tied_embeddings_stay_tied():
    model = tiny_model("llama", tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expand_layers(model, [0])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_k_zero_is_a_noop():
    model = tiny_model("llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert expand_layers(model, []) == []
    assert model.config.num_hidden_layers == 4 and not hasattr(model.config, "adept")
    assert all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("layers,match", [([4], "out of range"), ([-1], "out of range"), ([1, 1], "duplicate"),
                                          ([1.0], "must be ints"), ([True], "must be ints")])
def test_bad_indices_leave_the_model_untouched(layers, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        expand_layers(model, layers)
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4
    assert all(p.requires_grad for p in model.parameters())


def test_hybrid_and_unsupported_models_are_refused():
    """A linear-attention hybrid (Qwen3-Next) is refused naming its layers; a Qwen MoE with a
    sparse step a copy would shift is refused; neither model changes."""
    from transformers import Qwen3MoeConfig, Qwen3NextConfig

    cfg = Qwen3NextConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2,
                          num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                          linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=1,
                          linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])
    hybrid = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="unsupported architecture 'qwen3_next': its linear-attention layers"):
        expand_layers(hybrid, [0])
    assert len(hybrid.model.layers) == 2
    stepped = AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        decoder_sparse_step=2))
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        expand_layers(stepped, [0])
    assert len(stepped.model.layers) == 4 and stepped.config.num_hidden_layers == 4


def test_select_by_k_and_by_trainable_fraction():
    model = tiny_model("llama", layers=6)
    scores = layer_importance(model, padded_batches(), progress=False)
    assert select_layers(scores, k=2) == scores.select(2)
    with pytest.raises(ValueError, match="k must be"):
        select_layers(scores, k=7)
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    chosen = select_layers(scores, trainable_fraction=0.3, model=model)
    frac = len(chosen) * per_layer / (total + len(chosen) * per_layer)
    assert frac <= 0.3 and (len(chosen) + 1) * per_layer / (total + (len(chosen) + 1) * per_layer) > 0.3
    assert chosen == scores.select(len(chosen))
    with pytest.raises(ValueError, match="exactly one"):
        select_layers(scores)


def test_meta_device_full_size_config():
    cfg = AutoConfig.for_model("qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                               num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                               tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    trainable = expand_layers(model, list(range(4)))
    frac = sum(p.numel() for p in trainable) / sum(p.numel() for p in model.parameters())
    assert model.config.num_hidden_layers == 32 and 0.05 < frac < 0.2
