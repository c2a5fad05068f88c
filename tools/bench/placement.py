"""Cost of each Stage 1 placement criterion relative to ADEPT's importance probe (the same general
probe; domain_aware adds a bypass probe of the domain, plasticity one backward pass)."""
import functools

import torch

from bench.common import median_time, random_batches, random_model, row, smollm2


def run(args, device):
    from adept_ext import data
    from adept_ext.adept import placement

    if args.size == "large":
        model = random_model("qwen3-0.6b-shape", torch.bfloat16, device)
        general = random_batches(model.config.vocab_size, 2, 8, 512, device)
        domain = random_batches(model.config.vocab_size, 2, 8, 512, device, seed=2)
    else:
        model, tokenizer = smollm2(device)
        n_blocks = 2 if args.quick else 8

        def probe(corpus):
            blocks = data.token_blocks(data.load_texts(corpus)[:200], tokenizer, block_len=128)
            return data.batches({k: v[:n_blocks] for k, v in blocks.items()}, 4)

        general, domain = probe("bbc-news"), probe("python-docs")
    repeats = 1 if args.quick or args.size == "large" else 2
    results = {"layers": model.config.num_hidden_layers, "k": 4}
    for name in placement.PLACEMENTS:
        fn = functools.partial(placement.choose, name, model, 4, general, domain, progress=False)
        results[f"{name}_s"] = median_time(fn, device, repeats, 0)
        results[f"{name}_layers"] = fn()["layers"]
    base = results["importance_s"]
    print(f"\nplacement criteria on {model.config.num_hidden_layers} layers, k = 4, device {device}")
    for name in placement.PLACEMENTS:
        results[f"{name}_vs_importance"] = results[f"{name}_s"] / base
        print(f"{name:13} {results[name + '_s']:7.2f} s  {results[name + '_vs_importance']:5.2f}x importance  "
              f"layers {results[name + '_layers']}")
    return results


def rows(results):
    from adept_ext.adept import placement

    fields = {"shape": f"{results['layers']} layers, k {results['k']}"}
    return [r for name in placement.PLACEMENTS
            for r in (row(name, "time", results[f"{name}_s"], "s", **fields),
                      row(name, "time_vs_importance", results[f"{name}_vs_importance"], "x", **fields))]
