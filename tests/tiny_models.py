"""Tiny real Hugging Face models of every supported architecture (random weights, no downloads)."""
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from adept_ext.models import family_of

DENSE = ("gemma2", "gemma3_text", "phi3", "olmo2", "olmo3", "granite", "smollm3", "ministral3")
MOE = ("qwen3_moe", "mixtral", "olmoe")
ARCHS = ("llama", "qwen2", "qwen3", "mistral", *DENSE, *MOE)
# What each family's tiny config adds to the common fields (sliding windows, per-layer lists,
# Granite's multipliers and logit scaling, a dense layer among Qwen3-MoE's sparse ones).
EXTRA = {
    "gemma2": dict(head_dim=8, sliding_window=4, final_logit_softcapping=30.0),
    "gemma3_text": dict(head_dim=8, sliding_window=4, sliding_window_pattern=2),
    "olmo3": dict(sliding_window=4),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                    logits_scaling=8.0),
    "smollm3": dict(no_rope_layer_interval=2),
    "ministral3": dict(head_dim=8),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[2]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}


def tiny_config(arch, layers=4, vocab=97, tie=False, hidden=32):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.2, tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=6)
    if arch == "qwen2":  # q/k/v biases; sliding window on layers >= max_window_layers
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=2)
    if arch == "qwen3":  # q_norm/k_norm; alternating layer types
        types = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(layers)]
        return Qwen3Config(**common, head_dim=8, use_sliding_window=True, sliding_window=6, layer_types=types)
    return CONFIG_MAPPING[arch](**common, **EXTRA.get(arch, {}))


def tiny_model(arch, layers=4, seed=0, **kw):
    torch.manual_seed(seed)
    attention = "sdpa" if "sdpa" in family_of(arch).attention else "eager"  # Gemma 2: eager
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers, **kw), attn_implementation=attention)
    with torch.no_grad():  # make every bypass matter: randomise norms and biases too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


def save_whole_block_llama(directory):
    """Replace the tiny Llama in `directory` (its tokenizer kept) by one of hidden size 64, whose rows
    are whole NF4 blocks: `quantize.frozen_linears` holds every frozen projection of it (at 32 only
    the down projections)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(directory).vocab_size
    tiny_model("llama", layers=4, vocab=vocab, hidden=64).save_pretrained(directory)


def padded_batches(vocab=97, n_batches=2, batch=3, seq=12, seed=1):
    """Batches with right padding of different lengths (labels -100 at padding)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(2, vocab, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.long)
        for b in range(1, batch):
            mask[b, seq - 2 * b:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def write_run_workspace(root):
    """Files for runner tests under `root`: a tiny Llama with the real SmolLM2 tokenizer (`tiny/`),
    12 BBC News articles as a general corpus folder (`general/`) and 6 Python documentation topics
    as a JSONL domain corpus (`domain.jsonl`)."""
    import json

    from adept_ext import data
    from adept_ext.models import load_model

    tokenizer = load_model("smollm2-135m")[1]
    model = tiny_model("llama", layers=4, vocab=len(tokenizer))
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    (root / "general").mkdir()
    for i, text in enumerate(data.load_texts("bbc-news")[:12]):
        (root / "general" / f"{i}.txt").write_text(text)
    (root / "domain.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in data.load_texts("python-docs")[:6]))
    return root


def write_sequence_workspace(root):
    """`write_run_workspace` plus a two-task sequence: 4 Python documentation topics as a text
    task (`docs.txt`) and 15 BBC News topic-classification examples as an instruction task
    (`topics.jsonl`)."""
    import json

    from adept_ext import data

    write_run_workspace(root)
    (root / "docs.txt").write_text("\n\n".join(data.load_texts("python-docs")[:4]))
    topics = data.bbc_news_labelled()[::150]
    (root / "topics.jsonl").write_text("\n".join(json.dumps({"prompt": " ".join(t.split()[:12]) + "\nTopic:",
                                                            "answer": f" {c}"}) for t, c in topics))
    return root


LORA_TARGETS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                "up_proj.weight", "down_proj.weight")


def assert_merged_into_exact(saved, source, rank):
    """Each LoRA-adapted weight of `saved` (a state dict) is its `source` weight plus a change of rank
    ≤ `rank` (B·A merged in float32 into the exact weight): merged into a rounded copy (bfloat16 or 4
    bits), the change would carry the full-rank rounding error, σ_{rank+1} a large fraction of σ_1."""
    adapted = [k for k in source if k.endswith(LORA_TARGETS)]
    assert adapted
    for key in adapted:
        s = torch.linalg.svdvals((saved[key] - source[key]).double())
        assert s[0] > 0 and s[rank] <= 1e-4 * s[0], (key, float(s[rank] / s[0]))
