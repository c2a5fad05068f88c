"""One optimizer step of adept-ext's training loop (`training.train_steps`: the fused loss, bf16
autocast on a GPU, clipping, GroupedAdamW) against the same step in `transformers.Trainer` (the
model's own loss on full logits; PEFT for LoRA; `hf.MethodCallback` for ADEPT; Liger's fused
linear cross-entropy through `use_liger_kernel` when liger-kernel is installed), on the same
model, batch and sequence length, with and without activation checkpointing, for `full`, `lora`
and `adept`. Each configuration runs in a fresh process (the peak memory of one cannot hide in
memory another freed): tokens/s of the median measured step, and the peak memory above the built
model (CPU: resident set; GPU: the allocator's peak). Shown: the ratios to the Trainer's default
step of the same method (to its step with checkpointing at --size large, where by default only the
configurations with checkpointing run, those that fit an 80 GB H100; --full-table runs them all,
which needs an H200's 141 GB)."""
import functools
import multiprocessing as mp
import statistics
import time

import torch

from adept_ext.training.device import hold_frozen
from bench.common import measure_peak_mb, random_batches, random_model, row

# size: (model shape, batch, sequence length, measured steps). small is the CPU goal's size.
SIZES = {"small": ("smollm2-135m-shape", 4, 2048, 1), "quick": ("smollm2-135m-shape", 2, 256, 2),
         "large": ("llama-3.2-1b-shape", 8, 4096, 3)}
METHODS = ("full", "lora", "adept")
WARMUP_STEPS = 1


def configurations(liger: bool, size: str = "small", checkpointing_only: bool = False):
    """(method, loop, checkpointing) of every measured step (--size large: `full` only and no
    compilation, to fit the GPU check's budget); loop "adept_ext_hf_loss" is our loop with
    --loss-implementation hf (what the fused loss buys), "adept_ext_compile" our loop with --compile
    (each decoder layer compiled; the compilation is in the warm-up step, `first_step_s`).
    `checkpointing_only`: the configurations with activation checkpointing (hf_loss's too), the
    ones whose large size fits an 80 GB H100: without it, the Llama-3.2-1B shape's activations at
    8 x 4096 tokens (by estimate, about 55 GB in bf16) come on top of its weights, gradients and AdamW states in
    float32 (about 20 GB) and, in the Trainer, its logits (about 40 GB with their float32 copies)."""
    loops = ["adept_ext", "trainer"] + (["trainer_liger"] if liger else [])
    methods = ("full",) if size == "large" else METHODS
    configs = [(m, loop, ckpt) for m in methods for loop in loops for ckpt in (False, True)]
    compiled = [] if size == "large" else [("full", "adept_ext_compile", False), ("full", "adept_ext_compile", True)]
    configs += [("full", "adept_ext_hf_loss", checkpointing_only)] + compiled
    return [c for c in configs if c[2] or not checkpointing_only]


def liger_installed() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def prepared_task(method, model, device, steps):
    import adept_ext
    from adept_ext.methods import AdeptConfig, FullConfig, LoraMethodConfig

    config = {"full": FullConfig(), "lora": LoraMethodConfig(rank=8), "adept": AdeptConfig(k=4)}[method]
    probe = random_batches(model.config.vocab_size, 2, 2, 128, device, seed=2)
    return adept_ext.prepare(model, adept_ext.get_method(config), general_probe=probe, lr=1e-4, total_steps=steps,
                             progress=False)


def our_steps(task, batch, device, bf16, steps, loss_implementation, checkpointing, compile_layers=False):
    """`steps` steps of training.train_steps on `batch` (each decoder layer compiled first with
    `compile_layers`, after checkpointing, as the runner's --compile does); the wall time of each."""
    from types import SimpleNamespace

    from adept_ext.training import optimizer_for
    from adept_ext.training.loop import activation_checkpointing, compile_layers as compile_each_layer, train_steps

    cfg = SimpleNamespace(steps=steps, grad_accum=1, batch_size=batch["input_ids"].shape[0], lr=1e-4,
                          max_length=batch["input_ids"].shape[1], max_grad_norm=1.0, weight_decay=0.01, warmup_steps=0,
                          logging_steps=1,  # one loss read per step: the per-step timing waits for the GPU
                          dataloader_num_workers=0, optim="adamw_torch")
    task.loss_implementation = loss_implementation
    activation_checkpointing(task.model, checkpointing)
    compile_each_layer(task.model, compile_layers)
    optimizer, scheduler = optimizer_for(task, cfg)
    stamps = [time.perf_counter()]
    task.model.train()
    host = {k: v.cpu() for k, v in batch.items()}  # the loop's loader reads host batches (pinned on a GPU), as a run
    train_steps(task.model, task, optimizer, scheduler, [host], cfg, device, bf16, {"train": []}, 0, "", False,
                after_step=lambda step: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip(stamps, stamps[1:])]


def trainer_steps(task, method, batch, device, bf16, steps, checkpointing, liger):
    """`steps` steps of transformers.Trainer on `batch` (its default AdamW and loss); the time of
    each (on_step_begin to on_step_end)."""
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from adept_ext.hf import MethodCallback

    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    rows = [{k: v[i].cpu() for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]
    callbacks = [Clock()]
    model = task.model
    if method == "adept":  # the method's hooks (per-unit rates) in the Trainer
        callbacks.append(MethodCallback(task))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=len(rows), max_steps=steps,
                                 learning_rate=1e-4, max_grad_norm=1.0, report_to=[], save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, use_cpu=device.type == "cpu", bf16=bf16,
                                 gradient_checkpointing=checkpointing, use_liger_kernel=liger,
                                 gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizers = (torch.optim.AdamW(task.param_groups, lr=1e-4), None) if method == "adept" else (None, None)
        Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks, optimizers=optimizers).train()
    return times


def measure(config, size, device_name, steps=None):
    """In a fresh process: build the model (setup) then run the configuration's steps (the warm-up
    one, then `steps` measured, default the size's); returns (step times, peak MB above the built model)."""
    method, loop, checkpointing = config
    shape, batch_size, seq, size_steps = SIZES[size]
    steps = steps or size_steps
    device = torch.device(device_name)
    bf16 = device.type == "cuda"
    model = random_model(shape, torch.float32, device)
    batch = random_batches(model.config.vocab_size, 1, batch_size, seq, device)[0]
    total = WARMUP_STEPS + steps
    if loop.startswith("trainer") and method == "lora":
        from adept_ext.methods.lora import add_lora

        task = type("PeftTask", (), {"model": add_lora(model, 8)})()  # PEFT's own wrapper, as a Trainer user has
    else:
        task = prepared_task(method, model, device, total)
    if bf16 and loop.startswith("adept_ext"):  # the runner's --frozen-dtype auto under bf16 autocast
        hold_frozen(task.model, torch.bfloat16)
    weights_mb = sum(p.numel() * p.element_size() for p in task.model.parameters()) / 2**20
    if loop.startswith("trainer"):
        run = functools.partial(trainer_steps, task, method, batch, device, bf16, total, checkpointing,
                                loop == "trainer_liger")
    else:
        run = functools.partial(our_steps, task, batch, device, bf16, total,
                                "hf" if loop == "adept_ext_hf_loss" else "auto", checkpointing,
                                loop == "adept_ext_compile")
    times, peak = measure_peak_mb(run, device)
    return times, peak, weights_mb


def _child(queue, config, size, device_name, steps):
    queue.put(measure(config, size, device_name, steps))


def in_fresh_process(config, size, device_name, steps=None):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, config, size, device_name, steps))
    proc.start()
    proc.join()  # the small result fits the queue's pipe: the child exits without waiting for a reader
    if proc.exitcode != 0:  # e.g. killed for memory (-9)
        raise RuntimeError(f"exit code {proc.exitcode}")
    return queue.get(timeout=60)


def label(loop, checkpointing):
    return loop + ("+checkpointing" if checkpointing else "")


def run(args, device):
    size = "quick" if args.quick else args.size
    checkpointing_only = size == "large" and not args.full_table  # what fits an 80 GB H100
    shape, batch_size, seq, steps = SIZES[size]
    steps = getattr(args, "steps", None) or steps
    methods = (getattr(args, "methods", None) or ",".join(METHODS)).split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"train_step --methods: unknown {', '.join(unknown)} (choose among {', '.join(METHODS)})")
    tokens = batch_size * seq
    results = {"model": shape, "batch": batch_size, "seq": seq, "measured_steps": steps,
               "dtype": "float32" if device.type == "cpu" else "bf16 autocast; weights float32 (Trainer) or frozen "
                                                                "ones bfloat16 (adept_ext, --frozen-dtype auto)",
               "peak_memory_mb": "peak above the weights held at the start (weights_mb)",
               "liger_installed": liger_installed(), "checkpointing_only": checkpointing_only, "methods": {}}
    print(f"\none optimizer step, {shape}, {batch_size} x {seq} tokens, device {device} "
          f"({torch.get_num_threads()} threads); each configuration in a fresh process")
    for method, loop, checkpointing in configurations(results["liger_installed"], size, checkpointing_only):
        if method not in methods:
            continue
        name, providers = label(loop, checkpointing), results["methods"].setdefault(method, {})
        try:
            times, peak, weights_mb = in_fresh_process((method, loop, checkpointing), size, str(device), steps)
        except RuntimeError as e:  # one configuration that does not fit is a result, not the end of the run
            providers[name] = {"error": str(e)}
            print(f"{method:6} {name:28} failed: {e}", flush=True)
            continue
        step_s, first_step_s = statistics.median(times[WARMUP_STEPS:]), times[0]
        print(f"{method:6} {name:28} {tokens / step_s:9.1f} tokens/s, peak {peak:8.0f} MB "
              f"(+ weights {weights_mb:.0f} MB), first step {first_step_s:.1f} s", flush=True)
        providers[name] = {"step_s": step_s, "first_step_s": first_step_s, "tokens_per_s": tokens / step_s,
                           "peak_memory_mb": peak, "weights_mb": weights_mb}
    for method, providers in results["methods"].items():
        # the Trainer's default step, or with checkpointing when only those configurations ran
        base = providers[label("trainer", checkpointing_only)]
        for name, r in providers.items():
            if "error" in r or "error" in base:
                continue
            r["tokens_per_s_vs_trainer"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["peak_memory_vs_trainer"] = r["peak_memory_mb"] / base["peak_memory_mb"]
            r["with_weights_vs_trainer"] = ((r["peak_memory_mb"] + r["weights_mb"])
                                            / (base["peak_memory_mb"] + base["weights_mb"]))
            print(f"{method:6} {name:28} {r['tokens_per_s']:9.1f} tokens/s ({r['tokens_per_s_vs_trainer']:5.2f}x) "
                  f"peak {r['peak_memory_mb']:8.0f} MB ({r['peak_memory_vs_trainer']:5.2f}x; with the weights "
                  f"{r['with_weights_vs_trainer']:5.2f}x)")
    return results


def rows(results):
    shape = f"{results['model']}, {results['batch']} x {results['seq']} tokens"
    if results.get("checkpointing_only"):
        shape += "; ratios to trainer+checkpointing"
    return [row(name, metric, r[metric], unit, dtype=results["dtype"], shape=f"{method}: {shape}")
            for method, providers in results["methods"].items() for name, r in providers.items()
            for metric, unit in (("tokens_per_s", "tokens/s"), ("peak_memory_mb", "MB"), ("first_step_s", "s"),
                                 ("tokens_per_s_vs_trainer", "x"), ("peak_memory_vs_trainer", "x"),
                                 ("with_weights_vs_trainer", "x")) if metric in r]
