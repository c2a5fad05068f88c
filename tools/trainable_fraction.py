#!/usr/bin/env python
"""Trainable fraction of ADEPT expansion on full-size configs, on the meta device (no memory, no download).

    python tools/trainable_fraction.py
"""
import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from adept_ext.adept.expand import expand_layers

CONFIGS = {  # published shapes of the models
    "Qwen3-1.7B": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True),
    "Llama-3-8B": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}


def main():
    print(f"{'model':12} {'k':>3} {'layers':>7} {'params':>9} {'trainable':>10} {'fraction':>9}")
    for name, fields in CONFIGS.items():
        fields = dict(fields)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        for k in (4, 6):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
            n = config.num_hidden_layers
            # which layers does not change the count
            trainable = expand_layers(model, [round(i * n / k) for i in range(k)])
            total = sum(p.numel() for p in model.parameters())
            count = sum(p.numel() for p in trainable)
            print(f"{name:12} {k:3d} {model.config.num_hidden_layers:7d} {total / 1e9:8.2f}B "
                  f"{count / 1e6:9.0f}M {count / total:9.1%}")


if __name__ == "__main__":
    main()
