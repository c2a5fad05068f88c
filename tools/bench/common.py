"""The harness every benchmark shares: timing, the peak-memory measurement, the models and inputs
the benchmarks build, and result rows (one CSV for every run: docs/results/bench.csv)."""
import csv
import datetime
import functools
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import subprocess
import time

import torch

import adept_ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Nominal memory bandwidth (GB/s) of cards a GPU check may run on, to report a second fraction.
NOMINAL_GBPS = {"H200": 4800.0, "H100 80GB HBM3": 3350.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0}


# ---------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    """(fn(), its wall time in seconds), the device synchronised before the clock starts and stops."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def median_time(fn, device, repeats, warmup=2):
    """Median wall time of fn() over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device)[1] for _ in range(repeats))


def interleaved_median_times(fns, device, repeats, warmup=1):
    """{name: median wall time of fn()} of a dict of fns called in turn (A, B, A, B, ...), so that
    a slow phase of a shared machine hits each alike; `warmup` untimed rounds first."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device)[1])
    return {name: statistics.median(t) for name, t in times.items()}


# ---------------------------------------------------------------- peak memory
def measure_peak_mb(fn, device):
    """(fn(), the peak extra memory of the call in MB), in this process: on a GPU the CUDA
    allocator's peak above what was allocated before the call; on a CPU the resident set's
    high-water mark above its size before the call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, (torch.cuda.max_memory_allocated(device) - base) / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    base = _status_kb("VmRSS")
    out = fn()
    return out, (_status_kb("VmHWM") - base) / 1024


def peak_mb(fn, device, fresh=None):
    """Peak extra memory of fn() in MB: on a GPU the CUDA allocator's peak above what was allocated
    before the call; on a CPU the resident set's high-water mark above its size before the call.

    On a CPU, `fresh` measures in a new (spawned) process instead, so that memory this process freed
    earlier cannot hide the peak: a picklable fresh(setup_only=False, state=None) such as
    functools.partial(run_probe_method, method, n, "cpu"); the child calls fresh(setup_only=True)
    for the state (its memory is the baseline), then measures fresh(state=state)."""
    if device.type == "cuda" or fresh is None:
        return measure_peak_mb(fn, device)[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_fresh_process_peak, args=(queue, fresh))
    proc.start()
    proc.join()  # the one float it puts fits the queue's pipe: no wait for a reader
    if proc.exitcode != 0:
        raise RuntimeError(f"the process measuring {fresh} failed (exit code {proc.exitcode}; its traceback above)")
    return queue.get()


def _status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _fresh_process_peak(queue, fresh):
    state = fresh(setup_only=True)
    queue.put(measure_peak_mb(functools.partial(fresh, state=state), torch.device("cpu"))[1])


# ---------------------------------------------------------------- the machine
def machine_info(device, size):
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "device": str(device), "size": size,
            "cuda_kernels_compiled": adept_ext.cuda_available(),
            "cuda_arch_list": adept_ext.compiled_cuda_arch_list()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return info


def nominal_gbps(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in NOMINAL_GBPS.items() if k in name), None)


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- models and inputs
def qwen3_layer_shapes(n_layers):
    """Parameter shapes of Qwen3-0.6B-sized decoder layers: hidden 1024, intermediate 3072,
    16 q heads / 8 kv heads of dim 128, q/k norms (about 15.7M elements per layer)."""
    h, inter, hd, nq, nkv = 1024, 3072, 128, 16, 8
    layer = [(nq * hd, h), (nkv * hd, h), (nkv * hd, h), (h, nq * hd), (hd,), (hd,),
             (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return layer * n_layers


def llama1b_layer_shapes(n_layers):
    """Parameter shapes of Llama-3.2-1B-sized decoder layers: hidden 2048, intermediate 8192,
    32 q / 8 kv heads of dim 64, 2 norms (9 tensors, 60.8M elements per layer): 16 layers are
    144 tensors and 973M elements (the 1B scale), 8 layers 72 tensors and 487M."""
    h, inter, kv = 2048, 8192, 512
    layer = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return layer * n_layers


# Random-weight models of realistic shapes, built from configs (no downloads): --size large.
LARGE_MODELS = {
    "smollm2-135m-shape": ("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                                     "vocab_size": 49152, "tie_word_embeddings": True}),
    "qwen3-0.6b-shape": ("qwen3", {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                                   "vocab_size": 151936, "tie_word_embeddings": True}),
    "llama-3.2-1b-shape": ("llama", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                                     "vocab_size": 128256, "tie_word_embeddings": True}),
}


def random_model(name, dtype, device, **overrides):
    """A randomly initialised HF causal LM of LARGE_MODELS[name]'s shape (overrides: config fields)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape = LARGE_MODELS[name]
    config = AutoConfig.for_model(model_type, **{**shape, **overrides})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def random_batches(vocab, n_batches, batch, seq, device, seed=1):
    """Batches of uniformly random tokens (labels = input_ids), as the bench's stand-in corpus."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
                    "labels": ids.to(device)})
    return out


def smollm2(device):
    """(model, tokenizer) of the embedded SmolLM2-135M, the real model of the small sizes."""
    from adept_ext.models import load_model

    return load_model("smollm2-135m", device=device)


def touch_weights(model, input_ids):
    """One short forward, so that the (memory-mapped) weights count in a memory measurement's baseline."""
    with torch.no_grad():
        model(input_ids=input_ids[:1, :8])


def plot_dir(args):
    """Where a benchmark writes its figures: beside --json, else bench-results/."""
    out_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else "bench-results"
    os.makedirs(out_dir, exist_ok=True)
    return out_dir


# ---------------------------------------------------------------- result rows
# One row per figure; `source` says where it came from (a run of tools/bench.py, or a transcription).
CSV_FIELDS = ("benchmark", "provider", "size", "dtype", "shape", "metric", "value", "unit", "device", "commit",
              "date", "command", "source", "note")


def row(provider, metric, value, unit="", dtype="", shape=""):
    """A benchmark's part of a result row (run_rows adds where and when it was measured)."""
    return {"provider": provider, "metric": metric, "value": value, "unit": unit, "dtype": dtype, "shape": shape}


def format_value(value):
    if isinstance(value, (bool, int)):
        return str(int(value))
    return f"{value:.4g}"


def device_label(device):
    return f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type


def git_commit():
    """The checkout's short commit, with "+dirty" when tracked files differ from it ("" outside git).
    Read-only: GIT_OPTIONAL_LOCKS=0 keeps `git status` from refreshing the index."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        sha, dirty = (subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True, timeout=30,
                                     env=env, check=False).stdout.strip()
                      for cmd in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return ""
    return sha + ("+dirty" if sha and dirty else "")


def run_rows(benchmark, partial_rows, args, device, argv, commit=None):
    """Complete rows of one benchmark run: its figures, where, when and by which command. The size
    is --size's, with " --quick" added for a smoke run (fewer repeats, and smaller at most sizes)."""
    context = {"benchmark": benchmark, "size": args.size + (" --quick" if args.quick else ""),
               "device": device_label(device), "commit": git_commit() if commit is None else commit,
               "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
               "command": "python tools/bench.py " + shlex.join(argv), "source": "tools/bench.py", "note": ""}
    return [{**context, **r, "value": format_value(r["value"])} for r in partial_rows]


def append_csv(path, rows):
    """Append rows to the CSV at path (written with its header when new; an existing header must match)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
        if tuple(header or ()) != CSV_FIELDS:
            raise ValueError(f"{path}: its columns {header} are not {list(CSV_FIELDS)}")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != CSV_FIELDS:
            raise ValueError(f"{path}: its columns {reader.fieldnames} are not {list(CSV_FIELDS)}")
        return list(reader)
