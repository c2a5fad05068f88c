"""`--packing` against the other two ways a corpus becomes training rows of `max_length` tokens, on
real documents (BBC News articles: text; bbc-topic examples: instruction) and the SmolLM2 tokenizer:

- `wrapped`: today's text rows, the documents joined by EOS and cut every max_length tokens
  (`blocks.PackedBlocks`: no padding, but attention and positions run across documents);
- `padded`: one right-padded row per document (a longer one cut into pieces), as instruction data
  is today and as --packing keeps held-out rows (`packing.DocumentRows`);
- `packed`: --packing, best-fit decreasing, attention confined to each document (`packing.PackedRows`).

Measured: the padding fraction of every training row of the corpus (1 − tokens / (rows · max_length)),
the rows an epoch takes, and the real (non-padding) tokens per second of full-fine-tuning steps of
the training loop (`training.train_steps`, fused loss, AdamW) on a random-weight SmolLM2-135M-shaped
model over the first rows of each (after one warm-up step), each configuration in a fresh process."""
import multiprocessing as mp
import time
from types import SimpleNamespace

import numpy as np
import torch

from bench.common import random_model, row

# size: (max_length, batch, measured steps); the model is SmolLM2-135M's shape at every size.
SIZES = {"small": (1024, 2, 2), "quick": (256, 2, 1), "large": (4096, 8, 3)}
WARMUP_STEPS = 1
CONFIGURATIONS = (("text", "wrapped"), ("text", "padded"), ("text", "packed"), ("instruction", "padded"),
                  ("instruction", "packed"))


def corpora(tokenizer, max_length):
    """{data: {provider: block source}} for text (BBC News) and instruction (bbc-topic) data."""
    from adept_ext import data
    from adept_ext.data.packing import DocumentRows, PackedRows
    from adept_ext.data.tasks import instruction_blocks, topic_examples

    pad, eos = data.pad_id(tokenizer), tokenizer.eos_token_id
    ids = tokenizer(data.load_texts("bbc-news"), add_special_tokens=False)["input_ids"]
    documents = DocumentRows.of(ids, eos, max_length, pad)
    examples = data.TensorBlocks(instruction_blocks(topic_examples(), tokenizer, max_length))
    return {"text": {"wrapped": data.PackedBlocks(data.pack_stream(ids, eos), max_length, pad),
                     "padded": documents, "packed": PackedRows(documents, max_length, pad)},
            "instruction": {"padded": examples, "packed": PackedRows(examples, max_length, pad)}}


def real_tokens(source, indices):
    """Tokens of rows `indices` of `source` that are not padding (a packed row: its documents')."""
    from adept_ext.data.packing import PackedRows

    if isinstance(source, PackedRows):
        return int(sum(source.lengths[m] for i in indices for m in source.bins[i]))
    return int(source.rows(indices)["attention_mask"].sum())


def padding_fraction(source, max_length):
    """1 − real tokens / (rows · max_length) over every row of `source`."""
    return 1 - real_tokens(source, np.arange(len(source))) / (len(source) * max_length)


def steps_per_second(model, rows, batch, steps, device):
    """Real tokens per second of `steps` full fine-tuning steps of the training loop on the first rows."""
    import adept_ext
    from adept_ext.methods import FullConfig
    from adept_ext.training import optimizer_for
    from adept_ext.training.loop import train_steps

    chunks = [np.arange(i, i + batch) for i in range(0, batch * (WARMUP_STEPS + steps), batch)]
    batches = [rows.rows(chunk) for chunk in chunks]
    tokens = sum(real_tokens(rows, chunk) for chunk in chunks[WARMUP_STEPS:])
    task = adept_ext.prepare(model, adept_ext.get_method(FullConfig()), lr=1e-4, total_steps=len(batches),
                             progress=False)
    cfg = SimpleNamespace(steps=len(batches), grad_accum=1, batch_size=batch, lr=1e-4,
                          max_length=batches[0]["input_ids"].shape[1], max_grad_norm=1.0, weight_decay=0.01,
                          warmup_steps=0, logging_steps=1, dataloader_num_workers=0)
    optimizer, scheduler = optimizer_for(task, cfg)
    stamps = []
    task.model.train()
    train_steps(task.model, task, optimizer, scheduler, batches, cfg, device, False, {"train": []}, 0, "", False,
                after_step=lambda step: stamps.append(time.perf_counter()))
    return tokens / (stamps[-1] - stamps[WARMUP_STEPS - 1])


def measure(name, provider, max_length, batch, steps, device_name):
    """One configuration (data `name`, `provider`): its rows, padding fraction and real tokens/s."""
    from adept_ext.models import load_model

    device = torch.device(device_name)
    source = corpora(load_model("smollm2-135m")[1], max_length)[name][provider]
    model = random_model("smollm2-135m-shape", torch.float32, device)
    return {"rows": len(source), "padding_fraction": padding_fraction(source, max_length),
            "tokens_per_s": steps_per_second(model, source, batch, steps, device)}


def _child(queue, arguments):
    queue.put(measure(*arguments))


def in_fresh_process(*arguments):
    """`measure(*arguments)` in a spawned process, so that no configuration runs in memory another one
    left warm (in one process the first one measured was the slowest by up to 1.5 x)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, arguments))
    proc.start()
    proc.join()  # the small result fits the queue's pipe
    if proc.exitcode != 0:
        raise RuntimeError(f"measuring {arguments[:2]} failed (exit code {proc.exitcode})")
    return queue.get(timeout=60)


def run(args, device):
    size = "quick" if args.quick else args.size
    max_length, batch, steps = SIZES[size]
    results = {"model": "smollm2-135m-shape (random weights)", "max_length": max_length, "batch": batch,
               "measured_steps": steps, "data": {}}
    print(f"\n--packing: rows of {max_length} tokens, batches of {batch}, {steps} measured steps, device {device} "
          f"({torch.get_num_threads()} threads); each configuration in a fresh process")
    for name, provider in CONFIGURATIONS:
        r = in_fresh_process(name, provider, max_length, batch, steps, str(device))
        results["data"].setdefault(name, {})[provider] = r
        print(f"{name:11} {provider:8} {r['rows']:6} rows, padding {r['padding_fraction']:6.1%}, "
              f"{r['tokens_per_s']:8.1f} real tokens/s", flush=True)
    return results


def rows(results):
    shape = f"{results['model']}, rows of {results['max_length']} tokens, batch {results['batch']}"
    return [row(f"{name}: {provider}", metric, r[metric], unit, shape=shape)
            for name, providers in results["data"].items() for provider, r in providers.items()
            for metric, unit in (("rows", ""), ("padding_fraction", ""), ("tokens_per_s", "tokens/s"))]
