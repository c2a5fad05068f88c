#!/usr/bin/env python
"""The memory check's estimate (`training.device.memory_estimate`, in report.json's
"memory_estimate_mb") against the memory a run measurably takes, on a model small enough to run
here: `adept-ext run` on the embedded default for a few steps, per method and with and without
`--gradient-checkpointing`, each in a fresh process. The weights are counted as they are held, so
what is compared is what the steps add to them: the optimizer's state and gradients and the
activations (the estimate's "optimizer" + "activations") against the growth of memory while the
steps run, from just before them to its peak: on the CPU the process's anonymous resident memory
(`RssAnon`, sampled every 5 ms, with glibc told to give every freed block of 64 KiB or more
back at once, `MALLOC_MMAP_THRESHOLD_`, so that it follows the live tensors), on a GPU
`torch.cuda.max_memory_allocated` minus what was allocated before. Prints one JSON line per
setting, in MB. `--set OPTION=VALUE` passes any other run option to every run (e.g. `--set
frozen_dtype=nf4 --set optim=adamw_8bit --set bf16=on`, QLoRA's setting).

    python tools/memory_check.py [--methods lora,adept,full] [--batch-size 4] [--max-length 512] [--steps 3]
                                 [--set OPTION=VALUE ...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from load_memory import rss, sampled_peak  # noqa: E402 (the sibling tool's sampler)

MB = 2**20
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # glibc: each block of 64 KiB or more mapped alone, unmapped when freed


def measure(method: str, checkpointing: bool, args):
    import torch

    import adept_ext.training.loop as loop
    from adept_ext.train import RunConfig, config_from, run
    from adept_ext.training import typed_options

    cuda = torch.cuda.is_available()
    growth = []
    steps = loop.train_steps

    def measured_steps(*a, **kw):  # the memory the steps add to what the model already holds
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else rss()
        with sampled_peak() as peak:
            result = steps(*a, **kw)
        growth.append((torch.cuda.max_memory_allocated() if cuda else peak[0]) - before)
        return result

    loop.train_steps = measured_steps
    with tempfile.TemporaryDirectory() as out:
        cfg = config_from({"method": method, "out": out, "overwrite": True, "steps": args.steps,
                           "batch_size": args.batch_size, "max_length": args.max_length, "eval_blocks": 2,
                           "eval_every": 0, "probe_blocks": 2, "gradient_checkpointing": checkpointing,
                           **typed_options(RunConfig(), dict(item.split("=", 1) for item in args.set))})
        report = run(cfg, progress=False, log=lambda *a: None)
    estimate = report["memory_estimate_mb"]
    expected = estimate["optimizer"] + estimate["activations"]
    print(json.dumps({"method": method, "gradient_checkpointing": checkpointing, "set": args.set,
                      "batch": f"{args.batch_size} x {args.max_length}", "device": "cuda" if cuda else "cpu",
                      "estimate_mb": estimate, "steps_estimate_mb": expected,
                      "steps_measured_mb": round(growth[0] / MB),
                      "measured_over_estimate": round(growth[0] / MB / expected, 2)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="lora,adept,full")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="any other run option (adept-ext run's names with underscores), for every run")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child process: METHOD,CHECKPOINTING
    args = parser.parse_args()
    if args.measure:
        method, checkpointing = args.measure.split(",")
        return measure(method, checkpointing == "1", args)
    for method in args.methods.split(","):
        for checkpointing in ("0", "1"):  # each in a fresh process: nothing freed earlier is counted
            subprocess.run([sys.executable, __file__, "--measure", f"{method},{checkpointing}",
                            "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
                            "--steps", str(args.steps), *(f"--set={item}" for item in args.set)],
                           check=True, env={**os.environ, **MALLOC})


if __name__ == "__main__":
    main()
