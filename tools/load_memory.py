#!/usr/bin/env python
"""Host memory while a run loads its model (`models.load_model`): a random-weight Llama of about
1.1B parameters is saved as bfloat16 safetensors in shards, then loaded in a fresh process, once as
a run that holds its frozen weights in bfloat16 does (`held_dtype=torch.bfloat16`, as `--bf16` with
`--frozen-dtype auto|bfloat16|nf4`) and once in float32 (what every run did before). A sampler
thread reads the process's anonymous resident memory (`RssAnon` in /proc/self/status) every 5 ms;
the growth is its peak minus what the process held before loading. Prints one JSON line per load,
in GiB, with the weights as loaded, the largest shard, and the file-backed memory the loaded model
still maps (`RssFile` growth: safetensors' pages that weights loaded in their stored dtype share
with the page cache until they move to the device or are cast).

    python tools/load_memory.py [--dir /tmp/load-memory] [--shard-size 1GB]
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


def measure(path: Path, held: str):
    import torch

    from adept_ext.models import load_model

    before, before_file = rss(), rss("RssFile")
    with sampled_peak() as peak:
        model = load_model(path, held_dtype=getattr(torch, held))[0]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = max(f.stat().st_size for f in path.glob("*.safetensors"))
    growth = peak[0] - before
    print(json.dumps({"held_dtype": held, "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                      "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
                      "weights_gib": round(weights / GIB, 3), "largest_shard_gib": round(shard / GIB, 3),
                      "rss_anon_growth_gib": round(growth / GIB, 3),
                      "rss_file_after_gib": round((rss("RssFile") - before_file) / GIB, 3),
                      "ratio_to_weights_plus_shard": round(growth / (weights + shard), 3)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/load-memory", help="where the random model is saved (kept)")
    parser.add_argument("--shard-size", default="1GB", help="save_pretrained's max_shard_size")
    parser.add_argument("--measure", choices=["bfloat16", "float32"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    path = Path(args.dir)
    if args.measure:
        return measure(path, args.measure)
    if not (path / "config.json").exists():
        save_model(path, args.shard_size)
    for held in ("bfloat16", "float32"):  # each in a fresh process: nothing freed earlier is counted
        subprocess.run([sys.executable, __file__, "--dir", str(path), "--measure", held], check=True)


if __name__ == "__main__":
    main()
