#!/usr/bin/env python
"""The memory check's estimate (`adept_ext.training.device.memory_estimate`) for a model too large
for this machine: the model is built on the meta device from its config (no weights), the method's
trainable parameters are chosen as `adept-ext run` does (ADEPT: k function-preserving copies, the
originals frozen; LoRA: rank-r PEFT adapters; full: everything), the frozen weights are held in
float32, bfloat16 or NF4 (`--frozen-dtype`; nf4: the frozen linear layers at `quantize.nf4_bytes`,
the other frozen weights in bfloat16) and the optimizer's moments in float32 or 8 bits (`--optim`).
Prints one JSON line per setting, in GiB, per GPU, with what loading the model takes on the device
(`load_gib`, `models.check_load_memory`: the runners hold the weights in bfloat16 from the load on
under --frozen-dtype bfloat16 or nf4, the decoder's linear layers in 4 bits once a task starts;
with float32 frozen weights the model loads in float32).

    python tools/memory_estimate.py [--shape llama-3.1-8b] [--batch-size 1] [--max-length 4096] [--k 4]
"""
import argparse
import itertools
import json
import types

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from adept_ext.adept.expand import expand_layers
from adept_ext.models.held import release as release_frozen
from adept_ext.methods.lora import add_lora
from adept_ext.models import loaded_bytes
from adept_ext.models.quantize import frozen_linears, nf4_bytes
from adept_ext.training.device import hold_frozen, memory_estimate

SHAPES = {  # the published configs' shapes (no download)
    "llama-3.1-8b": lambda: LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                        tie_word_embeddings=False),
    "qwen3-8b": lambda: Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                    tie_word_embeddings=False),
}


def trainable_model(shape: str, method: str, k: int, rank: int):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(SHAPES[shape](), dtype=torch.float32)
    if method == "adept":  # the k copies: which layers does not change the estimate
        trainable = expand_layers(model, list(range(k)))
    elif method == "lora":
        model = add_lora(model, rank).get_base_model()
        trainable = [p for p in model.parameters() if p.requires_grad]
    else:
        trainable = list(model.parameters())
    return model, sum(p.numel() for p in trainable)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-length", "--block-len", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4, help="ADEPT's expanded layers")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    gib = 2**30
    load = {frozen: round(loaded_bytes(SHAPES[args.shape](), dtype) / gib, 1)
            for frozen, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("nf4", torch.bfloat16))}
    for method in ("adept", "lora", "full"):
        model, trainable = trainable_model(args.shape, method, args.k, args.lora_rank)
        for frozen, checkpointing, optim in itertools.product(("float32", "bfloat16", "nf4"), (False, True),
                                                              ("adamw_torch", "adamw_8bit")):
            if method == "full" and frozen == "nf4":
                continue  # nothing is frozen
            release_frozen(model)
            hold_frozen(model, torch.float32 if frozen == "float32" else torch.bfloat16)
            cfg = types.SimpleNamespace(batch_size=args.batch_size, max_length=args.max_length, optim=optim,
                                        loss_implementation="auto", gradient_checkpointing=checkpointing)
            estimate = memory_estimate(cfg, model, bf16=True, trainable=trainable, device=torch.device("cuda"))
            if frozen == "nf4":  # on the meta device nothing can be quantized: the held bytes by formula
                estimate["weights"] += int(sum(nf4_bytes(m.weight.numel()) - m.weight.nbytes
                                               for _, m in frozen_linears(model)))
            print(json.dumps({"shape": args.shape, "method": method, "frozen_dtype": frozen,
                              "gradient_checkpointing": checkpointing, "optim": optim,
                              "trainable_b": round(trainable / 1e9, 3),
                              "batch": f"{args.batch_size} x {args.max_length}",
                              **{k: round(v / gib, 1) for k, v in estimate.items()},
                              "total_gib": round(sum(estimate.values()) / gib, 1), "load_gib": load[frozen]}))


if __name__ == "__main__":
    main()
