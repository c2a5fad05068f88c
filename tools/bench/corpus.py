"""Tokenising a generated corpus into 128-token blocks: the in-memory path against large_corpus
(datasets map with worker processes, cached on disk, packed into a memory-mapped stream), each
load in a fresh process with a fresh cache, then the same load again (the cache hit)."""
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.common import row

CORPUS_CHILD = r"""
import json, resource, sys, time
from transformers import AutoTokenizer
from adept_ext import data
from adept_ext.models import resolve_checkpoint
path, mode, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m"))
start = time.perf_counter()
if mode == "today":  # what adept-ext run did before large_corpus: every text, then every block, in memory
    blocks = data.token_blocks(data.load_texts(path), tokenizer, 128)
    n_blocks, tokens = blocks["input_ids"].shape[0], int(blocks["attention_mask"].sum())
else:
    blocks = data.corpus_blocks(path, tokenizer, 128, workers)
    n_blocks, tokens = len(blocks), len(blocks.stream)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "blocks": n_blocks, "tokens": tokens,
                  "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def generated_corpus(megabytes, root):
    """`megabytes` MB of JSONL (8 files) of BBC News, Python docs and Python source documents drawn
    at random (seed 0): real text, so the tokenizer works as hard as on a user's corpus."""
    import random

    from adept_ext import data

    folder = os.path.join(root, f"corpus-{megabytes}mb")
    if os.path.isdir(folder):
        return folder
    texts = [json.dumps({"text": t}) + "\n" for name in data.BUILTIN_CORPORA for t in data.load_texts(name)]
    rng, target = random.Random(0), megabytes * 2 ** 20
    os.makedirs(folder + ".tmp", exist_ok=True)
    written = 0
    for i in range(8):
        with open(os.path.join(folder + ".tmp", f"part-{i}.jsonl"), "w") as f:
            while written < target * (i + 1) / 8:
                line = rng.choice(texts)
                f.write(line)
                written += len(line.encode())
    os.replace(folder + ".tmp", folder)
    return folder


def measure_corpus_load(path, mode, workers, cache, limit_mb):
    """Run one load in a fresh process (its own datasets cache); its wall time, tokens/s and peak
    resident memory (polled; the process is killed above `limit_mb`, reported as not finished)."""
    env = {**os.environ, "HF_DATASETS_CACHE": cache, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CORPUS_CHILD, path, mode, str(workers)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak, started = 0.0, time.perf_counter()
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            rss = 0.0
        peak = max(peak, rss)
        if peak > limit_mb:
            proc.kill()
            proc.wait()
            return {"mode": mode, "finished": False, "killed_above_mb": limit_mb,
                    "seconds_until_killed": round(time.perf_counter() - started, 1)}
        time.sleep(0.1)
    out = proc.stdout.read().strip().splitlines()
    if proc.returncode != 0 or not out:
        return {"mode": mode, "finished": False, "returncode": proc.returncode}
    result = json.loads(out[-1])
    return {"mode": mode, "finished": True, "workers": workers, "seconds": round(result["seconds"], 1),
            "tokens": result["tokens"], "blocks": result["blocks"],
            "tokens_per_second": round(result["tokens"] / result["seconds"]), "peak_rss_mb": round(peak),
            "worker_peak_rss_mb": round(result["worker_peak_rss_mb"])}


def run(args, device):
    """The module's comparison at 100 MB and 1 GB (16 MB with --quick), `workers` = the CPU count."""
    sizes = [16] if args.quick else [100, 1024]
    workers = os.cpu_count() or 1
    limit_mb = 16 * 1024
    root = os.environ.get("ADEPT_EXT_BENCH_DIR", os.path.join(tempfile.gettempdir(), "adept-ext-bench"))
    entries = []
    for megabytes in sizes:
        path = generated_corpus(megabytes, root)
        with tempfile.TemporaryDirectory(dir=root) as cache:
            entry = {"corpus_mb": megabytes,
                     "today": measure_corpus_load(path, "today", workers, cache, limit_mb),
                     "datasets": measure_corpus_load(path, "datasets", workers, cache, limit_mb),
                     "datasets_cached": measure_corpus_load(path, "datasets", workers, cache, limit_mb)}
        today, new = entry["today"], entry["datasets"]
        if today["finished"] and new["finished"]:
            entry["speedup"] = round(today["seconds"] / new["seconds"], 2)
            entry["rss_ratio"] = round(today["peak_rss_mb"] / max(new["peak_rss_mb"], 1), 1)
        print(json.dumps(entry))
        entries.append(entry)
    return {"limit_mb": limit_mb, "rows": entries}


def rows(results):
    out = []
    for r in results["rows"]:
        fields = {"shape": f"{r['corpus_mb']} MB JSONL corpus, 128-token blocks"}
        for provider, key in (("in_memory", "today"), ("datasets", "datasets"), ("datasets_cached", "datasets_cached")):
            load = r[key]
            if load["finished"]:
                out += [row(provider, "time", load["seconds"], "s", **fields),
                        row(provider, "tokens", load["tokens"] / 1e6, "M", **fields),
                        row(provider, "throughput", load["tokens_per_second"] / 1e6, "M tokens/s", **fields),
                        row(provider, "peak_rss", load["peak_rss_mb"] / 1024, "GB", **fields),
                        row(provider, "workers_peak_rss", load["worker_peak_rss_mb"] / 1024, "GB", **fields)]
            elif "killed_above_mb" in load:
                out += [row(provider, "killed_above", load["killed_above_mb"] / 1024, "GB", **fields),
                        row(provider, "time_until_killed", load["seconds_until_killed"], "s", **fields)]
    return out
