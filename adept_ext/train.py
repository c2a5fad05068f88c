"""The main job: continual pretraining of a causal LM on a domain corpus while keeping its
general ability — ADEPT (docs/methods.md §1) and the baselines it is compared with, on the same data and
token budget. The methods live in `adept_ext.methods` behind one registry; this runner only
calls their hooks.

`run(RunConfig(...))` loads the model and both corpora, measures the base model's held-out
general and domain loss, prepares the method (probe + expansion for ADEPT), trains with AdamW
(warmup + cosine, gradient accumulation and clipping, bf16 autocast on GPUs that support it),
evaluates periodically, writes atomic checkpoints (a killed run resumes to the same result),
and writes the adapted model (plain HF checkpoint), report.json, report.md and PNG plots.
The pieces shared with the task-sequence runner (`continual.py`) are here too: the options
both take, evaluation, the training loop, checkpoints and atomic writes.
"""
import json
import math
import os
import platform
import random
import resource
import shutil
import time
import types
import typing
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Dict, List

import torch
from tqdm.auto import tqdm

from . import data, parallel
from .lens import Diagnosis, diagnose
from .methods import Context, create, method_names
from .methods.adept import explicit_layers
from .methods.base import REGISTRY
from .models import adapter, load_model
from .optim import GroupedAdamW
from .placement import PLACEMENTS
from .report import plot_loss_curves
from .rundir import CHECKPOINT, InputError, RunError, atomic_dir, atomic_write, check_out, prepare_out

METHODS = tuple(method_names(single_domain=True))
DIAGNOSIS_TASKS = ("bbc-topic", "context")
LAYER_METHODS = tuple(name for name in METHODS if REGISTRY[name].takes_layers)  # methods that take k / --layers
PLACEMENT_METHODS = ("adept", "adept_uniform_lr", "adept_no_expand")  # Stage 1 by --placement


@dataclass
class TrainOptions:
    """Options of every runner (one domain or a task sequence), with their defaults."""

    model: str = "smollm2-135m"       # local HF checkpoint directory or an embedded model name
    out: str = "runs/run"             # output directory
    method: str = "adept"             # a registered method (adept_ext.methods)
    k: int = 4                        # layers to expand / train (adept, llama_pro, adept_no_expand, *_seq per task)
    block_len: int = 128              # tokens per block
    batch_size: int = 4               # blocks per micro-batch
    grad_accum: int = 1               # micro-batches per optimizer step
    steps: int = 40                   # optimizer steps (per task in a sequence)
    lr: float = 3e-4                  # base learning rate
    warmup_steps: int = 4             # linear warmup, then cosine decay to 0
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0        # gradient clipping (0 = off)
    probe_blocks: int = 8             # general blocks used to probe layers and score units
    eval_blocks: int = 16             # held-out blocks per corpus for evaluation
    save_every: int = 20              # checkpoint every N steps (0 = never)
    recompute_every: int = 20         # ADEPT: recompute unit importance every N steps
    normalize: str = "rank"           # ADEPT: unit-importance normalisation (rank, per_kind, global)
    lora_rank: int = 8
    seed: int = 0
    bf16: str = "auto"                # auto (GPU with bf16 support) | on | off
    device: str = "auto"              # auto | cpu | cuda
    parallel: str = "ddp"             # under torchrun: ddp | fsdp2 (parameters and optimizer state sharded)
    resume: bool = False              # continue the run in `out` from its last checkpoint
    overwrite: bool = False           # replace an existing run in `out`
    data_workers: int = 0             # processes tokenising a file/folder corpus (0 = the CPU count, at most 8)


@dataclass
class RunConfig(TrainOptions):
    """Every option of a one-domain run (the embedded default: SmolLM2-135M, BBC News as general
    corpus, Python docs as domain corpus, sized for a few minutes on 2 CPU cores)."""

    general: str = "bbc-news"         # general-domain corpus: file, folder, JSONL or built-in name
    domain: str = "python-docs"       # domain corpus (what the model is adapted to)
    layers: str = ""                  # explicit layers to expand / train, e.g. "7,14,21,29" (overrides k)
    placement: str = "importance"     # adept*: where the k layers go (adept_ext.placement.PLACEMENTS)
    probe_blocks: int = 4             # general blocks used to probe layers and score units (4 and 8 choose
                                      # the same layers of the embedded model at half the probe's time)
    eval_every: int = 20              # held-out evaluation every N steps (0 = only at the end)
    boundary: str = "half"            # freeze_deep: train layers [0, b): half | auto (LayerTracer diagnosis) | N
    diagnosis_task: str = "bbc-topic" # diagnosis inputs: bbc-topic (few-shot BBC News topics) | context (general blocks)
    diagnosis_queries: int = 8        # composite inputs used by the diagnosis
    streaming: bool = False           # read the corpora as streams (in corpus order, no cache; large_corpus)


def options_from(cls, overrides: Dict, sequence: bool = False):
    """`cls` (RunConfig or ContinualConfig) from a dict of options, with every value checked; the
    method is created once here so that its own options are checked too. RunError on bad input."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise RunError(f"unknown option(s): {', '.join(unknown)}")
    _check_types(cls, overrides)
    cfg = cls(**overrides)
    for name in ("block_len", "batch_size", "grad_accum", "steps", "probe_blocks", "eval_blocks", "recompute_every", "k"):
        if getattr(cfg, name) < 1:
            raise RunError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("warmup_steps", "save_every", "weight_decay", "max_grad_norm"):
        if not getattr(cfg, name) >= 0:
            raise RunError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise RunError(f"lr must be a finite number > 0, got {cfg.lr}")
    if cfg.block_len < 2:
        raise RunError(f"block_len must be >= 2 (a block needs a next token to score), got {cfg.block_len}")
    if cfg.data_workers < 0:
        raise RunError(f"data_workers must be >= 0 (0 = the CPU count), got {cfg.data_workers}")
    if cfg.bf16 not in ("auto", "on", "off"):
        raise RunError(f"bf16 must be auto, on or off, got {cfg.bf16!r}")
    if cfg.parallel not in parallel.ENGINES:
        raise RunError(f"parallel must be one of {', '.join(parallel.ENGINES)}, got {cfg.parallel!r}")
    if cfg.parallel == "fsdp2" and parallel.launched_world() < 2:
        raise RunError("--parallel fsdp2 shards the model over the processes of torchrun: launch with "
                       "`torchrun --nproc-per-node N` (N >= 2), or leave --parallel at ddp for one process")
    method = create(cfg.method, cfg, sequence=sequence)  # MethodError (a RunError) for the method's own options
    if cfg.parallel == "fsdp2" and not method.shardable:
        raise RunError(f"method {cfg.method} cannot train a model sharded by FSDP2 (its hooks need the whole "
                       "weights); use --parallel ddp")
    return cfg


def _check_types(cls, overrides: Dict):
    """RunError for a value of the wrong type (a TOML `lr = "1e-4"`, `steps = 2.5`): an int is
    accepted for a float option, a bool is never a number."""
    hints = typing.get_type_hints(cls)
    for name, value in overrides.items():
        want = hints[name]
        allowed = typing.get_args(want) if typing.get_origin(want) in (typing.Union, types.UnionType) else (want,)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not any(value is None if a is type(None) else
                   (numeric and a in (int, float) and (a is float or isinstance(value, int)))
                   or (a not in (int, float) and isinstance(value, a)) for a in allowed):
            names = " or ".join("none" if a is type(None) else a.__name__ for a in allowed)
            raise RunError(f"{name} must be of type {names}, got {value!r} ({type(value).__name__})")


def config_from(overrides: Dict) -> RunConfig:
    """A checked RunConfig from a dict of options (flags, TOML)."""
    if isinstance(overrides.get("layers"), list):  # TOML: layers = [7, 14]
        overrides = {**overrides, "layers": ",".join(map(str, overrides["layers"]))}
    if isinstance(overrides.get("boundary"), int):  # TOML: boundary = 12
        overrides = {**overrides, "boundary": str(overrides["boundary"])}
    cfg = options_from(RunConfig, overrides)
    if cfg.diagnosis_queries < 1:
        raise RunError(f"diagnosis_queries must be >= 1, got {cfg.diagnosis_queries}")
    if cfg.boundary not in ("half", "auto") and not cfg.boundary.isdigit():
        raise RunError(f"boundary must be half, auto or a layer count, got {cfg.boundary!r}")
    if cfg.diagnosis_task not in DIAGNOSIS_TASKS:
        raise RunError(f"diagnosis_task must be one of {', '.join(DIAGNOSIS_TASKS)}, got {cfg.diagnosis_task!r}")
    if cfg.layers and cfg.method not in LAYER_METHODS:
        raise RunError(f"--layers applies to {', '.join(LAYER_METHODS)}, not {cfg.method}")
    if cfg.placement not in PLACEMENTS:
        raise RunError(f"placement must be one of {', '.join(PLACEMENTS)}, got {cfg.placement!r}")
    if cfg.placement != "importance" and cfg.method not in PLACEMENT_METHODS:
        raise RunError(f"--placement applies to {', '.join(PLACEMENT_METHODS)}, not {cfg.method}")
    explicit_layers(cfg)
    return cfg


def _device(cfg) -> torch.device:
    """cpu, or this process's GPU (cuda:LOCAL_RANK under torchrun)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda: no GPU is available")
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    return parallel.local_device(kind)


def _use_bf16(cfg, device) -> bool:
    supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if cfg.bf16 == "on" and not supported:
        raise RunError("--bf16 on needs a GPU with bfloat16 support")
    return cfg.bf16 == "on" or (cfg.bf16 == "auto" and supported)


def _check_memory(cfg, model, bf16: bool = False, trainable: int = 0, shards: int = 1):
    """Refuse a run that will not fit in the available memory: the weights, the gradient and two
    AdamW moments (fp32) of the `trainable` parameters (divided among `shards` ranks under FSDP2),
    and one micro-batch's activations (halved under bf16 autocast). Called before anything is
    written (trainable = 0: can the model run at all?) and again once the method has chosen what
    trains. The estimate is in the message."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = trainable * 4 * 3 // shards
    per_token = 4 * c.num_hidden_layers * (16 * c.hidden_size + 4 * c.intermediate_size) + 8 * c.vocab_size
    activations = cfg.batch_size * cfg.block_len * per_token // (2 if bf16 else 1)
    need = weights + optimizer + activations
    if _device(cfg).type == "cuda":
        available = torch.cuda.mem_get_info()[0] + weights  # the weights are already on the device
    else:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) * 1024
    if need > available:
        advice = ("lower --batch-size and raise --grad-accum" if activations > optimizer
                  else "train fewer parameters (a smaller --k, a LoRA method) or use a device with more memory")
        raise RunError(f"batch_size {cfg.batch_size} x block_len {cfg.block_len} with {trainable / 1e6:.1f}M trainable "
                       f"parameters needs about {need / 2**30:.1f} GiB (weights {weights / 2**30:.1f}, optimizer "
                       f"{optimizer / 2**30:.1f}, activations {activations / 2**30:.1f}) but {available / 2**30:.1f} GiB "
                       f"are available: {advice}")


@torch.no_grad()
def evaluate(model, batches, device, desc="eval", progress=True) -> float:
    """Token-weighted mean next-token loss on `batches`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
            batch = {k: v.to(device) for k, v in batch.items()}
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch, use_cache=False).loss) * n
            count += n
    finally:
        model.train(was_training)
    return total / count


def data_workers(cfg) -> int:
    """Processes that tokenise a file, folder or saved-dataset corpus: `data_workers`, or for 0 the
    CPU count (at most 8)."""
    return cfg.data_workers or min(8, os.cpu_count() or 1)


class Corpora:
    """Token blocks of both corpora: general probe + held-out, domain train + held-out.

    Default: each corpus is cut into blocks (`data.corpus_blocks`: file, folder and saved-dataset
    corpora through Hugging Face datasets, memory-mapped) and split by a seeded shuffle, 10 % held
    out; the training batches are read lazily. `streaming`: blocks in corpus order (no shuffle,
    no cache): the first `eval_blocks` are held out, the probe blocks follow, the domain's
    training batches are everything after the held-out blocks, read as the run consumes them."""

    def __init__(self, cfg, tokenizer):
        self.tokenizer = tokenizer
        with parallel.rank_zero_first():  # rank 0 tokenises and caches; the others then read its cache
            self._streamed(cfg, tokenizer) if cfg.streaming else self._packed(cfg, tokenizer)

    def _packed(self, cfg, tokenizer):
        workers = data_workers(cfg)
        general, domain = (data.corpus_blocks(source, tokenizer, cfg.block_len, workers)
                           for source in (cfg.general, cfg.domain))
        g_train, g_held = data.split_views(general, cfg.seed, "the general corpus")
        d_train, d_held = data.split_views(domain, cfg.seed, "the domain corpus")
        b = cfg.batch_size
        self.general_probe = list(g_train.first(cfg.probe_blocks).batches(b))
        self.general_context = list(g_train.first(cfg.diagnosis_queries).batches(b))  # diagnosis
        self.general_eval = list(g_held.first(cfg.eval_blocks).batches(b))
        self.domain_eval = list(d_held.first(cfg.eval_blocks).batches(b))
        self.domain_train = d_train.batches(b)
        self.domain_probe = list(d_train.first(cfg.probe_blocks).batches(b))  # placements

    def _streamed(self, cfg, tokenizer):
        from .large_corpus import BlockStream, StreamBatches

        general, domain = (BlockStream(source, tokenizer, cfg.block_len) for source in (cfg.general, cfg.domain))
        e, b = cfg.eval_blocks, cfg.batch_size
        g = general.take(e + max(cfg.probe_blocks, cfg.diagnosis_queries))
        d = domain.take(e + cfg.probe_blocks)
        self.general_eval = general.batches(g[:e], b)
        self.general_probe = general.batches(g[e:e + cfg.probe_blocks], b)
        self.general_context = general.batches(g[e:e + cfg.diagnosis_queries], b)
        self.domain_eval = domain.batches(d[:e], b)
        self.domain_probe = domain.batches(d[e:], b)
        self.domain_train = StreamBatches(domain, e, b)


def diagnosis_batches(cfg, corpora) -> List[Dict[str, torch.Tensor]]:
    """Composite inputs s_1 ⊕ s_2 for LayerTracer (docs/methods.md §3): few-shot BBC News topic
    classification (bbc-topic), or the general probe blocks split in half into context and
    query (context)."""
    if cfg.diagnosis_task == "bbc-topic":
        return data.fewshot_topic_task(corpora.tokenizer, n_queries=cfg.diagnosis_queries, shots=3, words=24,
                                       batch_size=cfg.batch_size, seed=cfg.seed)
    return data.context_query_task(corpora.general_context, cfg.block_len // 2)


def run_diagnosis(model, cfg, corpora, importance=None, progress=True) -> Diagnosis:
    """LayerTracer's logit lens and layer sensitivity on `cfg.diagnosis_task` (see lens.py)."""
    try:
        return diagnose(model, diagnosis_batches(cfg, corpora), importance, progress=progress)
    except (FileNotFoundError, InputError) as e:
        raise RunError(f"diagnosis: {e}") from e


def _schedule(cfg):
    def factor(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def _rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_steps(model, method, setup, optimizer, scheduler, batches, cfg, device, bf16, history: Dict, step: int,
                desc: str, progress: bool, after_step: Callable[[int], None]) -> int:
    """AdamW steps from `step` up to `cfg.steps` over `batches` (cycled, `cfg.grad_accum` micro-
    batches per step and rank, bf16 autocast when `bf16`, gradient clipping), the loss from
    `method.loss`; appends the loss (mean over ranks) to `history["train"]` and calls
    `after_step(step)` after each step. Returns the step. Under data parallelism `model` is the
    DDP-wrapped model and rank r takes micro-batches r, r + W, … (see `parallel`)."""
    world, rank = parallel.world_size(), parallel.rank()
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, disable=not progress)
    try:
        while step < cfg.steps:
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                batch = batches[((step * cfg.grad_accum + micro) * world + rank) % len(batches)]
                batch = {k: v.to(device) for k, v in batch.items()}
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = method.loss(model, batch) / cfg.grad_accum
                loss.backward()
                loss_sum += float(loss.detach())
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(setup.trainable, cfg.max_grad_norm)
            note = method.step_note()
            if note:
                bar.set_postfix_str(f"{note} …")
            optimizer.step()
            scheduler.step()
            step += 1
            loss_sum = parallel.mean_over_ranks(loss_sum, device)
            history["train"].append({"step": step, "loss": loss_sum, "lr": scheduler.get_last_lr()[0]})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum:.3f}")
            after_step(step)
    finally:
        bar.close()
    return step


def optimizer_for(method, setup, cfg):
    """AdamW over the method's param groups (`GroupedAdamW`: AdamW's arithmetic, every group in
    one multi-tensor pass, so ADEPT's per-unit groups cost no extra launches) with warmup +
    cosine, and the method's step hooks."""
    optimizer = GroupedAdamW(setup.groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))
    method.attach(optimizer)
    return optimizer, scheduler


def training_state(model, method, optimizer, scheduler) -> Dict:
    """What a checkpoint needs to continue a task exactly: trainable weights, optimizer, schedule,
    the method's state and every RNG. A sharded (FSDP2) model's weights and optimizer state are
    not in it: every rank writes its shards with `save_sharded_state`."""
    state = {"scheduler": scheduler.state_dict(), "method": method.state_dict(), "rng": _rng_state(),
             "world_size": parallel.world_size()}
    if not parallel.is_sharded(model):
        state.update(trainable={n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
                     optimizer=optimizer.state_dict())
    return state


def read_checkpoint(out: Path) -> Dict:
    """The checkpoint of the run in `out`, for --resume. RunError when it was written by another
    number of processes: which micro-batches each rank takes, and a sharded run's shards, follow
    the world size, so resuming on another one would not continue the same run."""
    checkpoint = torch.load(out / CHECKPOINT, weights_only=False)
    world = parallel.world_size()
    saved = checkpoint.get("world_size", world)  # checkpoints from before the count was recorded: not checked
    if saved != world:
        raise RunError(f"--resume: the run in {out} was checkpointed by {saved} process(es) and this is {world}: "
                       f"resume it with the same number of processes ({saved})")
    return checkpoint


SHARDS = "checkpoint-shards"  # sharded runs: the DCP directory of a checkpoint is SHARDS-<step>


def save_sharded_state(out: Path, step: int, model, optimizer) -> Dict:
    """Sharded (FSDP2) runs: every rank writes its shards of the weights and optimizer state into
    `out/SHARDS-<step>` (a collective); returns the entry that names it in the checkpoint (empty
    for an unsharded model). The checkpoint file, written afterwards, is what makes it current."""
    if not parallel.is_sharded(model):
        return {}
    parallel.save_sharded(out / f"{SHARDS}-{step}", model, optimizer)
    return {"shards": f"{SHARDS}-{step}"}


def remove_stale_shards(out: Path, keep: str = ""):
    """Delete the shard directories of `out` other than `keep` (rank 0, after the checkpoint naming `keep`)."""
    for path in out.glob(f"{SHARDS}-*"):
        if path.name != keep:
            shutil.rmtree(path, ignore_errors=True)


def load_training_state(state: Dict, model, method, optimizer, scheduler, out: Path = None):
    """Restore what `training_state` saved (and, for a sharded model, its shards from `out`)."""
    if "shards" in state:
        parallel.load_sharded(out / state["shards"], model, optimizer)
    else:
        names = dict(model.named_parameters())
        for name, value in state["trainable"].items():
            names[name].data.copy_(value)
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    method.load_state_dict(state["method"])
    _set_rng_state(state["rng"])


def shard(model, setup, bf16: bool):
    """FSDP2: shard `model` (each decoder layer, then the root) and return `setup` with its
    trainable parameters and optimizer groups pointing at the sharded parameters."""
    new = parallel.fully_shard_model(model, adapter(model).layers, bf16)
    return replace(setup, trainable=[new(p) for p in setup.trainable],
                   groups=[{**g, "params": [new(p) for p in g["params"]]} for g in setup.groups])


def run(cfg: RunConfig, progress: bool = True, log=print) -> Dict:
    """All stages of a run; returns the report (also written to `cfg.out`). Under torchrun
    (WORLD_SIZE > 1) the ranks train one model with DistributedDataParallel (or FSDP2 under
    `parallel="fsdp2"`) and rank 0 writes."""
    device = _device(cfg)
    return parallel.run_on_ranks(device, lambda progress_, log_: _run(cfg, device, progress_, log_), progress, log)


def _run(cfg: RunConfig, device, progress, log) -> Dict:
    started = time.time()
    main = parallel.is_main()
    bf16 = _use_bf16(cfg, device)
    checkpoint = read_checkpoint(check_out(cfg, "run")) if cfg.resume else None
    method = create(cfg.method, cfg)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    try:
        model, tokenizer = load_model(cfg.model, device=device)
        method.check(model)
    except (FileNotFoundError, InputError) as e:
        raise RunError(str(e)) from e
    _check_memory(cfg, model, bf16)
    try:
        corpora = Corpora(cfg, tokenizer)
    except (FileNotFoundError, InputError) as e:
        raise RunError(str(e)) from e
    out = prepare_out(cfg, "run") if main else Path(cfg.out)
    parallel.barrier(device)
    report = {"config": asdict(cfg), "stages": {}, "machine": {"device": str(device), "threads": torch.get_num_threads(),
                                                                 "platform": platform.platform(), "bf16": bf16,
                                                                 "processes": parallel.world_size()}}

    def stage(name, t0, **extra):
        report["stages"][name] = {"seconds": round(time.time() - t0, 2), "peak_memory_mb": round(_peak_memory_mb(device)), **extra}

    t0 = time.time()
    base = checkpoint["base"] if checkpoint else {
        "general_loss": evaluate(model, corpora.general_eval, device, "eval general (base)", progress),
        "domain_loss": evaluate(model, corpora.domain_eval, device, "eval domain (base)", progress)}
    stage("base_eval", t0, **base)
    log(f"base model: general loss {base['general_loss']:.4f}, domain loss {base['domain_loss']:.4f}")

    t0 = time.time()
    ctx = Context(corpora.general_probe, corpora.domain_probe, progress, torch.bfloat16 if bf16 else None,
                  diagnosis_batches=lambda: diagnosis_batches(cfg, corpora), log=log)
    setup = method.prepare(model, ctx, layers=checkpoint["layers"] if checkpoint else None)
    total_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in setup.trainable)
    _check_memory(cfg, model, bf16, n_trainable, parallel.world_size() if cfg.parallel == "fsdp2" else 1)
    stage("prepare", t0, layers=setup.layers, trainable_parameters=n_trainable,
          trainable_fraction=n_trainable / total_params)
    if main:
        method.write_artifacts(out)
    log(f"{cfg.method}: {setup.summary}; trainable {n_trainable / 1e6:.1f}M ({n_trainable / total_params:.1%})")

    if cfg.parallel == "fsdp2":  # options_from checked that torchrun started several processes
        setup = shard(model, setup, bf16)
        trained = model
    else:
        trained = parallel.wrap(model, device)
    optimizer, scheduler = optimizer_for(method, setup, cfg)
    history = {"train": [], "eval": []}
    step = 0
    if checkpoint:
        load_training_state(checkpoint, model, method, optimizer, scheduler, out)
        history, step = checkpoint["history"], checkpoint["step"]
        log(f"resumed at step {step}")

    def save_checkpoint():
        shards = save_sharded_state(out, step, model, optimizer)
        if not main:
            return
        state = {"step": step, "layers": setup.layers, "base": base, "history": history, **shards,
                 **training_state(model, method, optimizer, scheduler)}
        atomic_write(out / CHECKPOINT, lambda tmp: torch.save(state, tmp))
        remove_stale_shards(out, shards.get("shards", ""))

    def after_step(done):
        nonlocal step
        step = done
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            history["eval"].append({"step": step,
                                    "general_loss": evaluate(model, corpora.general_eval, device, "eval general", progress),
                                    "domain_loss": evaluate(model, corpora.domain_eval, device, "eval domain", progress)})
        if cfg.save_every and step % cfg.save_every == 0:
            save_checkpoint()

    t0 = time.time()
    model.train()
    try:
        step = train_steps(trained, method, setup, optimizer, scheduler, corpora.domain_train, cfg, device, bf16,
                           history, step, f"training ({cfg.method})", progress, after_step)
    except KeyboardInterrupt:
        if parallel.is_sharded(model):  # saving is a collective the other ranks may never join
            log(f"interrupted at step {step}: continue from the last checkpoint in {out} with --resume")
        else:
            save_checkpoint()
            log(f"interrupted at step {step}: checkpoint saved in {out}; continue with --resume")
        raise
    stage("train", t0, steps=step, tokens=step * cfg.grad_accum * cfg.batch_size * cfg.block_len)

    t0 = time.time()
    final = {"general_loss": evaluate(model, corpora.general_eval, device, "eval general (final)", progress),
             "domain_loss": evaluate(model, corpora.domain_eval, device, "eval domain (final)", progress)}
    history["eval"].append({"step": step, **final})
    stage("final_eval", t0, **final)

    t0 = time.time()
    parallel.unshard_model(model)  # FSDP2: the whole weights on every rank (a collective), for end_task
    final_model = method.end_task(model, out if main else None, report)
    if main:
        atomic_dir(out / "model", lambda tmp: (final_model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
        plot_loss_curves(history, base, out / "loss_curves.png", title=f"{cfg.method}: training and held-out loss")
    stage("save", t0)

    report.update({
        "method": cfg.method, "layers": setup.layers, "summary": setup.summary, "base": base, "final": final,
        "forgetting_general_delta": final["general_loss"] - base["general_loss"],
        "gain_domain_delta": base["domain_loss"] - final["domain_loss"],
        "perplexity": {"base_general": math.exp(base["general_loss"]), "final_general": math.exp(final["general_loss"]),
                       "base_domain": math.exp(base["domain_loss"]), "final_domain": math.exp(final["domain_loss"])},
        "trainable_parameters": n_trainable, "trainable_fraction": n_trainable / total_params,
        "history": history, "plots": sorted(p.name for p in out.glob("*.png")),
        "wall_seconds": round(time.time() - started, 1)})
    if main:
        atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2)))
        atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(markdown_report(report)))
        (out / CHECKPOINT).unlink(missing_ok=True)  # the run is complete: the model replaces it
        remove_stale_shards(out)
    log(f"final: general loss {final['general_loss']:.4f} (forgetting {report['forgetting_general_delta']:+.4f}), "
        f"domain loss {final['domain_loss']:.4f} (gain {report['gain_domain_delta']:+.4f}); report: {out / 'report.md'}")
    parallel.barrier(device)  # every rank returns once rank 0 has written the run
    return report


def markdown_report(report: Dict) -> str:
    cfg, base, final = report["config"], report["base"], report["final"]
    lines = [f"# adept_ext run: {report['method']}", "",
             f"Model `{cfg['model']}`, general corpus `{cfg['general']}`, domain corpus `{cfg['domain']}`; "
             f"{cfg['steps']} steps of {cfg['grad_accum']} micro-batch(es) x {cfg['batch_size']} blocks x "
             f"{cfg['block_len']} tokens, lr {cfg['lr']}, "
             f"seed {cfg['seed']}, device {report['machine']['device']}.", "",
             "| | general loss | general ppl | domain loss | domain ppl |", "|---|---|---|---|---|",
             f"| base | {base['general_loss']:.4f} | {math.exp(base['general_loss']):.2f} | {base['domain_loss']:.4f} | {math.exp(base['domain_loss']):.2f} |",
             f"| final | {final['general_loss']:.4f} | {math.exp(final['general_loss']):.2f} | {final['domain_loss']:.4f} | {math.exp(final['domain_loss']):.2f} |",
             "", f"Forgetting (general Δloss): {report['forgetting_general_delta']:+.4f}; "
             f"gain (domain −Δloss): {report['gain_domain_delta']:+.4f}.", "",
             f"Trainable parameters: {report['trainable_parameters'] / 1e6:.2f}M ({report['trainable_fraction']:.1%}): "
             f"{report['summary']}. Layer numbers are those of the model before expansion unless said otherwise.", "", "| stage | seconds | peak memory MB |", "|---|---|---|"]
    lines += [f"| {name} | {s['seconds']} | {s['peak_memory_mb']} |" for name, s in report["stages"].items()]
    if "unit_rates" in report:
        lines += ["", f"Per-unit learning-rate multipliers (mean {report['unit_rates']['mean_multiplier']:.3f}, "
                      f"{report['unit_rates']['recomputes']} recomputes): see `unit_rates.png`."]
    lines += ["", "Plots: " + ", ".join(f"`{name}`" for name in report["plots"]) + "."]
    return "\n".join(lines) + "\n"
