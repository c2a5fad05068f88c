"""Per-unit learning rates: an AdamW step with one param group against per-unit groups with
DecoupledLR (torch AdamW and GroupedAdamW), all three on the gradients of one backward, and the
unit-importance recompute (the fused op against plain per-tensor torch)."""
import copy
import functools
import os
import statistics

import torch

from bench.common import median_time, plot_dir, random_batches, random_model, row, smollm2, timed


def plain_recompute(model, units, batches, autocast_dtype=None):
    """The recompute written with plain per-tensor PyTorch ops (what a user would write)."""
    params = dict(model.named_parameters())
    tensors = [params[u.name] for u in units]
    totals = [0.0] * len(tensors)
    device = tensors[0].device
    for batch in batches:
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(**batch, use_cache=False).loss
        grads = torch.autograd.grad(loss, tensors)
        for i, (p, g) in enumerate(zip(tensors, grads)):
            totals[i] += (p.detach() * g).abs().mean().item()
    return [t / len(batches) for t in totals]


def forward_backward(model, batch, device, autocast=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        loss = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss
    loss.backward()


def same_gradient_steps(model, steppers, batches, device, autocast=None, warmup=2):
    """Step every optimizer of `steppers` (name -> (a copy of `model`, an optimizer of it)) on the
    gradients of ONE forward+backward per batch, `model`'s, copied into the parameters of the same
    name: optimizers compared on them see the same gradients whatever the backward's determinism
    (SDPA's is not deterministic on CUDA). The seconds after `warmup` batches:
    {"forward_backward": [...], name: [its optimizer's step, ...]}."""
    times = {"forward_backward": [], **{name: [] for name in steppers}}
    for i, batch in enumerate(batches):
        seconds = {"forward_backward": timed(functools.partial(forward_backward, model, batch, device, autocast),
                                             device)[1]}
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for name, (target, opt) in steppers.items():
            for n, p in target.named_parameters():
                if n in grads:
                    p.grad = grads[n].clone()
            seconds[name] = timed(opt.step, device)[1]
        if i >= warmup:
            for name, s in seconds.items():
                times[name].append(s)
    return times


@torch.no_grad()
def max_abs_diff(model, other):
    """The largest |difference| between the trainable weights of two copies of a model."""
    return max(float((p - q).abs().max()) for p, q in zip(model.parameters(), other.parameters()) if p.requires_grad)


def lr_setup(args, device):
    """(model expanded with 4 copies, the copied layers, train batches, probe batches, description)."""
    from adept_ext import data
    from adept_ext.adept.expand import expand_layers
    from adept_ext.adept.probe import layer_importance

    steps = 4 if args.quick else 12
    if args.size == "large":
        model = random_model("qwen3-0.6b-shape", torch.float32, device)
        n, vocab = model.config.num_hidden_layers, model.config.vocab_size
        chosen = [n // 4 - 1, n // 2 - 1, 3 * n // 4 - 1, n - 1]  # random weights: spread, not probed
        b, t = (2, 128) if args.quick else (8, 1024)
        train_batches = random_batches(vocab, steps + 2, b, t, device, seed=1)
        probe = random_batches(vocab, 2, b, t, device, seed=2)
        description = f"Qwen3-0.6B shape (random fp32 weights), batch {b}x{t}"
    else:
        model, tokenizer = smollm2(device)
        general = data.token_blocks(data.load_texts("bbc-news")[:300], tokenizer, block_len=128)
        domain = data.token_blocks(data.load_texts("python-docs"), tokenizer, block_len=128)
        chosen = layer_importance(model, data.batches(general, 2, limit=1), progress=False).select(4)
        train_batches = data.batches(domain, 4, limit=steps + 2)
        probe = data.batches({k: v[-8:] for k, v in domain.items()}, 2)  # 8 x 128 probe tokens, not trained on
        description = "SmolLM2-135M, batch 4x128 Python-docs tokens"
    expand_layers(model, chosen)
    return model, chosen, train_batches, probe, description


def run(args, device):
    from adept_ext.adept.lr import DecoupledLR, param_groups
    from adept_ext.optim import GroupedAdamW
    from adept_ext.report import plot_unit_rates
    from adept_ext.adept.units import UnitImportance

    model, chosen, train_batches, probe, description = lr_setup(args, device)
    # On a GPU the steps run under bf16 autocast, as the training runner does, and the recompute is
    # timed both as DecoupledLR calls it by default (fp32) and in the training's precision.
    autocast = torch.bfloat16 if device.type == "cuda" else None
    plain_model = copy.deepcopy(model).train()
    plain_opt = torch.optim.AdamW([p for p in plain_model.parameters() if p.requires_grad], lr=1e-4,
                                  weight_decay=0.01)
    ours_model = copy.deepcopy(model).train()
    # The same per-unit groups with GroupedAdamW (what the runners use): one multi-tensor pass for every group.
    grouped_model = copy.deepcopy(model).train()
    del model
    ours_opt = torch.optim.AdamW(param_groups(ours_model, 1e-4, weight_decay=0.01))
    grouped_opt = GroupedAdamW(param_groups(grouped_model, 1e-4, weight_decay=0.01))
    importance = UnitImportance(ours_model, probe)
    decoupled = DecoupledLR(ours_opt, importance, every=10**9, autocast_dtype=autocast)  # no recompute in the steps
    # The same rates: the scores of a recompute on a GPU may differ in their last bits.
    DecoupledLR(grouped_opt, UnitImportance(grouped_model, probe), every=10**9,
                autocast_dtype=autocast).load_state_dict(decoupled.state_dict())

    # One forward+backward per batch (ours_model's), its gradients copied into the other two models.
    times = same_gradient_steps(ours_model, {"plain": (plain_model, plain_opt), "decoupled": (ours_model, ours_opt),
                                             "grouped": (grouped_model, grouped_opt)},
                                train_batches, device, autocast)
    fb = times.pop("forward_backward")
    step_s = {name: statistics.median(f + s for f, s in zip(fb, t)) for name, t in times.items()}
    plain_s, ours_s, grouped_s = step_s["plain"], step_s["decoupled"], step_s["grouped"]
    grouped_diff = max_abs_diff(ours_model, grouped_model)
    del plain_model, plain_opt, grouped_model, grouped_opt

    repeats = 1 if args.quick else 3
    fused_recompute = median_time(lambda: importance.raw_scores(), device, repeats, 1)
    plain_recompute_s = median_time(lambda: plain_recompute(ours_model, importance.units, probe), device, repeats, 1)
    torch.testing.assert_close(torch.tensor(importance.raw_scores()),
                               torch.tensor(plain_recompute(ours_model, importance.units, probe), dtype=torch.float32),
                               rtol=1e-3, atol=1e-12)
    decoupled.recompute()
    mult = decoupled.multipliers
    results = {
        "model": description, "expanded_layers": ours_model.config.adept["expanded_layers"], "units": len(mult),
        "autocast": str(autocast).replace("torch.", "") if autocast else None,
        "plain_step_s": plain_s, "decoupled_step_s": ours_s, "adamw_groups_step_overhead": ours_s / plain_s - 1,
        "grouped_step_s": grouped_s, "step_overhead": grouped_s / plain_s - 1,
        "forward_backward_s": statistics.median(fb),
        "optimizer_step_s": {name: statistics.median(t) for name, t in times.items()},
        "grouped_max_abs_diff_vs_adamw": grouped_diff,
        "recompute_fused_s": fused_recompute, "recompute_plain_s": plain_recompute_s,
        "recompute_speedup": plain_recompute_s / fused_recompute,
    }
    if autocast:
        results["recompute_fused_autocast_s"] = median_time(
            lambda: importance.raw_scores(autocast_dtype=autocast), device, repeats, 1)
        results["recompute_plain_autocast_s"] = median_time(
            lambda: plain_recompute(ours_model, importance.units, probe, autocast), device, repeats, 1)
        results["recompute_autocast_speedup_vs_fp32"] = fused_recompute / results["recompute_fused_autocast_s"]
        results["recompute_autocast_speedup_vs_plain"] = (results["recompute_plain_autocast_s"]
                                                          / results["recompute_fused_autocast_s"])
    results["mean_multiplier_after_recompute"] = decoupled.mean_multiplier
    results["rates"] = {u.name: m for u, m in zip(importance.units, mult)}
    for normalize in ("per_kind", "global", "rank"):
        imp = UnitImportance(ours_model, probe, normalize=normalize, autocast_dtype=autocast)
        results[f"mean_multiplier_{normalize}"] = (sum(max(2 * (1 - s), decoupled.floor) for s in imp.compute())
                                                   / len(mult))
    source_scores = importance.compute(use_source=True, autocast_dtype=autocast)
    results["mean_multiplier_source_scores"] = (sum(max(2 * (1 - s), decoupled.floor) for s in source_scores)
                                                / len(mult))
    results["heatmap"] = os.path.join(plot_dir(args), f"unit_rates{'_large' if args.size == 'large' else ''}.png")
    plot_unit_rates(importance.units, mult, results["heatmap"],
                    title=f"ADEPT per-unit lr multipliers, {description.split(',')[0]}, copies of {chosen}")

    print(f"\nDecoupledLR on {description}, expanded at {chosen} ({len(mult)} units), AdamW, device {device}"
          f"{', bf16 autocast' if autocast else ''}")
    print(f"step: one group {plain_s * 1e3:.0f} ms; per-unit groups with DecoupledLR: torch AdamW "
          f"{ours_s * 1e3:.0f} ms "
          f"({results['adamw_groups_step_overhead'] * 100:+.1f}%), GroupedAdamW {grouped_s * 1e3:.0f} ms "
          f"({results['step_overhead'] * 100:+.1f}%), each with the one forward+backward "
          f"({results['forward_backward_s'] * 1e3:.0f} ms); the largest difference of GroupedAdamW's weights from "
          f"AdamW's: {grouped_diff:.3g}")
    print(f"recompute on the probe batches: fused {fused_recompute:.2f} s, plain per-tensor {plain_recompute_s:.2f} s "
          f"-> speedup {results['recompute_speedup']:.2f}x")
    if autocast:
        print(f"recompute under bf16 autocast: fused {results['recompute_fused_autocast_s']:.2f} s "
              f"({results['recompute_autocast_speedup_vs_fp32']:.2f}x the fp32 one), plain per-tensor "
              f"{results['recompute_plain_autocast_s']:.2f} s")
    print("mean lr multiplier: " + ", ".join(f"{k[len('mean_multiplier_'):]} {v:.3f}" for k, v in results.items()
                                             if k.startswith("mean_multiplier_")))
    print(f"{'unit':48} {'multiplier':>10}")
    for u, m in zip(importance.units, mult):
        print(f"{u.name:48} {m:10.3f}")
    print(f"heatmap: {results['heatmap']}")
    return results


def rows(results):
    fields = {"dtype": results["autocast"] or "float32",
              "shape": f"{results['model']}, {len(results['expanded_layers'])} copies, {results['units']} units"}
    out = [row("adamw_one_group", "step_time", results["plain_step_s"] * 1e3, "ms", **fields),
           row("adamw_per_unit_groups", "step_time", results["decoupled_step_s"] * 1e3, "ms", **fields),
           row("adamw_per_unit_groups", "step_overhead", results["adamw_groups_step_overhead"] * 100, "%", **fields),
           row("grouped_adamw", "step_time", results["grouped_step_s"] * 1e3, "ms", **fields),
           row("grouped_adamw", "step_overhead", results["step_overhead"] * 100, "%", **fields),
           row("grouped_adamw", "max_abs_diff_weights_vs_adamw", results["grouped_max_abs_diff_vs_adamw"], "",
               **fields),
           row("forward_backward", "time", results["forward_backward_s"] * 1e3, "ms", **fields),
           *(row(provider, "optimizer_step_time", results["optimizer_step_s"][name] * 1e3, "ms", **fields)
             for name, provider in (("plain", "adamw_one_group"), ("decoupled", "adamw_per_unit_groups"),
                                    ("grouped", "grouped_adamw"))),
           row("adept_ext", "recompute_time", results["recompute_fused_s"], "s", **fields),
           row("torch_per_tensor", "recompute_time", results["recompute_plain_s"], "s", **fields),
           row("adept_ext", "recompute_speedup", results["recompute_speedup"], "x", **fields)]
    if "recompute_fused_autocast_s" in results:
        out += [row("adept_ext_autocast", "recompute_time", results["recompute_fused_autocast_s"], "s", **fields),
                row("torch_per_tensor_autocast", "recompute_time", results["recompute_plain_autocast_s"], "s",
                    **fields),
                row("adept_ext_autocast", "recompute_speedup_vs_fp32", results["recompute_autocast_speedup_vs_fp32"],
                    "x", **fields)]
    out += [row(normalize, "mean_lr_multiplier", results[f"mean_multiplier_{normalize}"], "", **fields)
            for normalize in ("rank", "per_kind", "global", "source_scores")]
    return out
