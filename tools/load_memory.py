#!/usr/bin/env python
"""Host memory while a run loads its model (`models.load_model`): a random-weight Llama of about
1.1B parameters is saved as bfloat16 safetensors in shards, then loaded in a fresh process onto
`--device` in float32, as `continual` loads it, or with `--hold bfloat16` held in bfloat16, as `run`
loads it under --frozen-dtype bfloat16 or nf4 with bf16 autocast. A sampler thread reads the process's anonymous
resident memory (`RssAnon` in /proc/self/status) every 5 ms; the growth is its peak minus what the
process held before loading. On the CPU the host is the device and holds the float32 weights; on a
GPU the host should hold little more than the tensor being converted (the shards are mapped, not
read into anonymous memory). Prints one JSON line, in GiB, with the weights as loaded and the
largest shard.

    python tools/load_memory.py [--dir /tmp/load-memory] [--shard-size 1GB] [--device cpu|cuda] [--hold bfloat16]
"""
import argparse
import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 2**30


def rss(kind: str = "RssAnon") -> int:
    """This process's resident memory of `kind` (RssAnon, RssFile) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(kind + ":")) * 1024


@contextlib.contextmanager
def sampled_peak():
    """Yields [peak]: the largest `rss()` seen while the block ran, sampled every 5 ms (set at its end)."""
    peak, done = [rss()], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()
        peak[0] = max(peak[0], rss())


def save_model(path: Path, shard_size: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from adept_ext.models import resolve_checkpoint

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)  # TinyLlama-1.1B's shape
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size=shard_size)
    AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m")).save_pretrained(path)


def measure(path: Path, device: str, hold: str):
    import torch

    from adept_ext.models import load_model

    before, before_file = rss(), rss("RssFile")
    with sampled_peak() as peak:
        model = load_model(path, device=device, hold=getattr(torch, hold) if hold else None)[0]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = max(f.stat().st_size for f in path.glob("*.safetensors"))
    growth = peak[0] - before
    print(json.dumps({"device": device, "hold": hold or None,
                      "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                      "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
                      "weights_gib": round(weights / GIB, 3), "largest_shard_gib": round(shard / GIB, 3),
                      "host_rss_anon_growth_gib": round(growth / GIB, 3),
                      "host_rss_file_after_gib": round((rss("RssFile") - before_file) / GIB, 3)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/load-memory", help="where the random model is saved (kept)")
    parser.add_argument("--shard-size", default="1GB", help="save_pretrained's max_shard_size")
    parser.add_argument("--device", default="cpu", help="where the model is loaded (cpu, cuda)")
    parser.add_argument("--hold", default="", choices=["", "bfloat16"],
                        help="hold the weights in this dtype (run's load)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    path = Path(args.dir)
    if args.measure:
        return measure(path, args.device, args.hold)
    if not (path / "config.json").exists():
        save_model(path, args.shard_size)
    # in a fresh process: nothing the saving freed is counted
    subprocess.run([sys.executable, __file__, "--dir", str(path), "--device", args.device, "--hold", args.hold,
                    "--measure"], check=True)


if __name__ == "__main__":
    main()
