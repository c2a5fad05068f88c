"""Layer sensitivity (LayerTracer) on SmolLM2 few-shot BBC News topics: layer_sensitivity's
prefix-shared variants against the naive loop (one perturbed HF forward per layer, full logits)."""
import functools

import torch

from adept_ext import reference
from bench.common import peak_mb, row, smollm2, timed, touch_weights


def lens_setup(n_queries, device):
    from adept_ext.lens.inputs import fewshot_topic_task

    model, tokenizer = smollm2(device)
    batches = [{k: v.to(device) for k, v in b.items()}
               for b in fewshot_topic_task(tokenizer, n_queries=n_queries, shots=2, words=16, batch_size=n_queries)]
    touch_weights(model, batches[0]["input_ids"])
    return model, batches


def run_lens_method(method, n_queries, device, setup_only=False, state=None):
    """Layer sensitivity on SmolLM2 few-shot BBC topics: naive (one perturbed full forward per
    layer, HF logits) or fused (prefix-shared variants); in-process for timing, in a child for memory."""
    from adept_ext.lens import layer_sensitivity

    model, batches = state or lens_setup(n_queries, torch.device(device))
    if setup_only:
        return model, batches
    if method == "naive":
        b = batches[0]
        return reference.context_masked_js(model, b, b["context_mask"], b["score_mask"]).mean(1).tolist()
    return layer_sensitivity(model, batches, progress=False).js


def run(args, device):
    n_queries = 1 if args.quick else 4
    state = lens_setup(n_queries, device)
    b = state[1][0]
    results = {"queries": n_queries, "tokens": int(b["attention_mask"].sum()),
               "layers": state[0].config.num_hidden_layers, "task": "few-shot BBC News topics, 2 shots x 16 words"}
    timed_js = {}
    for method in ("naive", "fused"):  # one timed run each, in this process (a naive run takes minutes on a CPU)
        timed_js[method], results[f"{method}_s"] = timed(
            functools.partial(run_lens_method, method, n_queries, device, state=state), device)
    naive, fused = timed_js["naive"], timed_js["fused"]
    results["max_rel_diff_js"] = max(abs(a - w) / w for a, w in zip(fused, naive))
    results["speedup_vs_naive"] = results["naive_s"] / results["fused_s"]
    for method in ("naive", "fused"):
        results[f"peak_mem_{method}_mb"] = peak_mb(
            functools.partial(run_lens_method, method, n_queries, device, state=state), device,
            fresh=functools.partial(run_lens_method, method, n_queries, "cpu"))
    results["js"] = fused
    print(f"\nlayer sensitivity on SmolLM2-135M ({results['layers']} layers), {n_queries} few-shot BBC queries "
          f"({results['tokens']} tokens), device {device}")
    print(f"naive (one perturbed HF forward per layer): {results['naive_s']:.2f} s, "
          f"peak +{results['peak_mem_naive_mb']:.0f} MB")
    print(f"adept_ext prefix-shared:                    {results['fused_s']:.2f} s, "
          f"peak +{results['peak_mem_fused_mb']:.0f} MB  -> speedup {results['speedup_vs_naive']:.2f}x")
    print(f"max rel. diff of JS per layer {results['max_rel_diff_js']:.2e}")
    return results


def rows(results):
    queries = f"{results['queries']} quer{'y' if results['queries'] == 1 else 'ies'}"
    fields = {"dtype": "float32", "shape": f"SmolLM2-135M, few-shot BBC topics: {queries}, {results['tokens']} tokens"}
    return [row("naive", "time", results["naive_s"], "s", **fields),
            row("adept_ext", "time", results["fused_s"], "s", **fields),
            row("adept_ext", "speedup_vs_naive", results["speedup_vs_naive"], "x", **fields),
            row("naive", "peak_extra_memory", results["peak_mem_naive_mb"], "MB", **fields),
            row("adept_ext", "peak_extra_memory", results["peak_mem_fused_mb"], "MB", **fields),
            row("adept_ext", "max_rel_diff_js", results["max_rel_diff_js"], "", **fields)]
