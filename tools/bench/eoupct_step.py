"""One optimizer step (loss, backward, clipping, AdamW) of seq_lora against eoupct on the same
model and batch, in the same run: eoupct adds the proxy gradient (every step), the prompt search
with the virtual step (every eoupct_proxy_every steps, averaged over such a cycle), and the
projections. Shown: the ratio eoupct / seq_lora (the target is <= 3 on a CPU)."""
import functools

import torch

from bench.common import median_time, random_batches, random_model, row, smollm2


def smollm2_model(device):
    return smollm2(device)[0]


def train_steps(n, task, batch, optimizer):
    """n optimizer steps of a prepared task on one batch: loss, backward, clipping, AdamW."""
    for _ in range(n):
        optimizer.zero_grad(set_to_none=True)
        task.method.loss(task.model, batch).backward()
        torch.nn.utils.clip_grad_norm_(task.trainable, 1.0)
        optimizer.step()


def run(args, device):
    import adept_ext
    from adept_ext.continual import ContinualConfig
    from adept_ext.methods import create
    from adept_ext.training import optimizer_for

    if args.size == "large":
        make = functools.partial(random_model, "qwen3-0.6b-shape", torch.float32, device)
        batch_size, seq = 8, 512
    else:
        make = functools.partial(smollm2_model, device)
        batch_size, seq = (1, 64) if args.quick else (2, 128)
    cycles = 1 if args.quick else 2
    results = {"batch": batch_size, "seq": seq}
    for name, extra in (("seq_lora", {}), ("eoupct", {}), ("eoupct_embeds", {"eoupct_proxy": "embeds"})):
        cfg = ContinualConfig(method=name.split("_embeds")[0], lora_rank=4, steps=100, warmup_steps=0, **extra)
        model = make()
        batch = random_batches(model.config.vocab_size, 1, batch_size, seq, device)[0]
        task = adept_ext.prepare(model, create(cfg.method, cfg, sequence=True), lr=cfg.lr, total_steps=cfg.steps,
                                 weight_decay=cfg.weight_decay, progress=False)
        optimizer, _ = optimizer_for(task, cfg)
        model.train()
        # eoupct_proxy_every steps: one with the prompt search, the others without
        cycle = functools.partial(train_steps, cfg.eoupct_proxy_every, task, batch, optimizer)
        results[f"{name}_step_s"] = median_time(cycle, device, cycles, warmup=1) / cfg.eoupct_proxy_every
        del model, task, optimizer, cycle
    base = results["seq_lora_step_s"]
    print(f"\none optimizer step, batch {batch_size} x {seq} tokens, device {device} "
          f"({torch.get_num_threads()} threads)")
    for name in ("seq_lora", "eoupct", "eoupct_embeds"):
        results[f"{name}_vs_seq_lora"] = results[f"{name}_step_s"] / base
        print(f"{name:14} {results[name + '_step_s'] * 1e3:9.1f} ms  {results[name + '_vs_seq_lora']:5.2f}x seq_lora")
    return results


def rows(results):
    fields = {"dtype": "float32", "shape": f"batch {results['batch']} x {results['seq']} tokens"}
    return [r for name in ("seq_lora", "eoupct", "eoupct_embeds")
            for r in (row(name, "step_time", results[f"{name}_step_s"], "s", **fields),
                      row(name, "time_vs_seq_lora", results[f"{name}_vs_seq_lora"], "x", **fields))]
