"""Replay's costs against seq_lora on SmolLM2-135M in one run (docs/methods.md §5, "Replay"): one
optimizer step on a batch of 4 TREC questions (trec-loc), a quarter of them replayed
(replay_ratio 0.25), for seq_lora, replay, replay with distillation (replay_distill 1, top-k 20
stored) and replay with the slow EMA copy (ema_decay 0.9), timed in turn; and the work at a task's
end per component, on trec-loc's 2 % buffer (m rows): its stored top-k, the surprise scores of
every training row, m generated pseudo examples. With the memory each keeps."""
import functools

import torch

from bench.common import interleaved_median_times, row, smollm2, timed
from bench.eoupct_step import train_steps

STEP_CONFIGS = (("seq_lora", "seq_lora", {}), ("replay", "replay", {}),
                ("replay_distill", "replay", {"replay_distill": 1.0}), ("replay_ema", "replay", {"ema_decay": 0.9}))


def run(args, device):
    import adept_ext
    from adept_ext import data
    from adept_ext.continual import ContinualConfig
    from adept_ext.data.tasks import load_tasks
    from adept_ext.methods import create
    from adept_ext.methods.pseudo_examples import pseudo_examples
    from adept_ext.methods.replay import SLOT, row_losses, top_k_log_probs
    from adept_ext.training import optimizer_for

    if args.size == "large":
        raise SystemExit("replay_step measures SmolLM2-135M on TREC at the small size only")
    model, tokenizer = smollm2(device)
    rows = load_tasks("trec-loc", tokenizer, 128, 0)[0].train
    m = max(1, round(0.02 * len(rows)))
    kept = data.BlockSet(rows, list(range(m)))
    batch = {**rows.rows(range(m, m + 4)), SLOT: torch.tensor([-1, -1, -1, 0])}
    results = {"rows": len(rows), "buffer_rows": m}
    stored, results["top_k_s"] = timed(lambda: top_k_log_probs(model, kept, 20), device)
    results["stored_bytes"] = sum(t.numel() * t.element_size() for t in stored.values())
    results["surprise_s"] = timed(lambda: row_losses(model, rows), device)[1]
    generated, results["generate_s"] = timed(lambda: pseudo_examples(model, rows, m, 1.0, 0, progress=False), device)
    results["generated_rows"] = len(generated["input_ids"])

    steps = {}
    for name, method, extra in STEP_CONFIGS:
        cfg = ContinualConfig(method=method, replay_base="lora", lora_rank=8, steps=100, warmup_steps=0, **extra)
        step_model = smollm2(device)[0]
        task = adept_ext.prepare(step_model, create(method, cfg, sequence=True), lr=cfg.lr, total_steps=cfg.steps,
                                 weight_decay=cfg.weight_decay, task_index=1, progress=False)
        if method == "replay":
            task.method.kept = {0: list(range(m))}
            task.method.stored = {0: stored}
        optimizer, _ = optimizer_for(task, cfg)  # the method's step hooks attached (the EMA update)
        step_model.train()
        step_batch = batch if method == "replay" else {k: v for k, v in batch.items() if k != SLOT}
        steps[name] = functools.partial(train_steps, 1, task, {k: v.to(device) for k, v in step_batch.items()},
                                        optimizer)
        if extra.get("ema_decay"):
            results["ema_bytes"] = sum(p.numel() * p.element_size() for p in task.trainable)
    times = interleaved_median_times(steps, device, 1 if args.quick else 5)
    for name, _, _ in STEP_CONFIGS:
        results[f"{name}_step_s"] = times[name]
        results[f"{name}_vs_seq_lora"] = times[name] / times["seq_lora"]
    print(f"\nreplay on trec-loc ({len(rows)} rows, a 2 % buffer of {m}), device {device} "
          f"({torch.get_num_threads()} threads)")
    for name, _, _ in STEP_CONFIGS:
        print(f"{name:15} step {times[name] * 1e3:8.1f} ms  {results[name + '_vs_seq_lora']:5.2f}x seq_lora")
    print(f"at the task's end: top-k of {m} rows {results['top_k_s']:.2f} s ({results['stored_bytes']} bytes), "
          f"surprise over {len(rows)} rows {results['surprise_s']:.2f} s, {results['generated_rows']} pseudo "
          f"examples {results['generate_s']:.2f} s; EMA copy {results['ema_bytes'] / 2**20:.1f} MiB")
    return results


def rows(results):
    fields = {"dtype": "float32", "shape": f"trec-loc, batch 4 x 128 tokens, buffer {results['buffer_rows']} rows"}
    return ([r for name, _, _ in STEP_CONFIGS
             for r in (row(name, "step_time", results[f"{name}_step_s"], "s", **fields),
                       row(name, "time_vs_seq_lora", results[f"{name}_vs_seq_lora"], "x", **fields))]
            + [row("replay_distill", "top_k_time", results["top_k_s"], "s", **fields),
               row("replay_distill", "stored_bytes", results["stored_bytes"], "B", **fields),
               row("replay_surprise", "score_time", results["surprise_s"], "s", **fields),
               row("replay_generated", "generate_time", results["generate_s"], "s", **fields),
               row("replay_ema", "ema_bytes", results["ema_bytes"], "B", **fields)])
