"""The main job: continual pretraining of a causal LM on a domain corpus while keeping its
general ability — ADEPT (SPEC §1) and the baselines it is compared with, on the same data and
token budget.

`run(RunConfig(...))` loads the model and both corpora, measures the base model's held-out
general and domain loss, prepares the method (probe + expansion for ADEPT), trains with AdamW
(warmup + cosine, gradient accumulation and clipping, bf16 autocast on GPUs that support it),
evaluates periodically, writes atomic checkpoints (a killed run resumes to the same result),
and writes the adapted model (plain HF checkpoint), report.json, report.md and PNG plots.
"""
import json
import math
import os
import platform
import random
import resource
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional

import torch
from tqdm.auto import tqdm

from . import data
from .expand import expand_layers
from .lens import Diagnosis, allocate, diagnose
from .lr import DecoupledLR, param_groups
from .models import adapter, load_model
from .probe import layer_importance
from .report import plot_loss_curves, plot_unit_rates
from .units import UnitImportance

METHODS = ("adept", "full", "llama_pro", "freeze_deep", "lora", "adept_no_expand", "adept_uniform_lr")
DIAGNOSIS_TASKS = ("bbc-topic", "context")
LAYER_METHODS = ("adept", "llama_pro", "adept_no_expand", "adept_uniform_lr")  # methods that take k / --layers
CHECKPOINT = "checkpoint.pt"


@dataclass
class RunConfig:
    """Every option of a run, with its default (the embedded default: SmolLM2-135M, BBC News as
    general corpus, Python docs as domain corpus, sized for a few minutes on 2 CPU cores)."""

    model: str = "smollm2-135m"       # local HF checkpoint directory or an embedded model name
    general: str = "bbc-news"         # general-domain corpus: file, folder, JSONL or built-in name
    domain: str = "python-docs"       # domain corpus (what the model is adapted to)
    out: str = "runs/demo"            # output directory
    method: str = "adept"             # one of METHODS
    k: int = 4                        # layers to expand / train (adept, llama_pro, adept_no_expand)
    layers: str = ""                  # explicit layers to expand / train, e.g. "7,14,21,29" (overrides k)
    block_len: int = 128              # tokens per block
    batch_size: int = 4               # blocks per micro-batch
    grad_accum: int = 1               # micro-batches per optimizer step
    steps: int = 60                   # optimizer steps
    lr: float = 3e-4                  # base learning rate
    warmup_steps: int = 6             # linear warmup, then cosine decay to 0
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0        # gradient clipping (0 = off)
    probe_blocks: int = 8             # general blocks used to probe layers and score units
    eval_blocks: int = 16             # held-out blocks per corpus for evaluation
    eval_every: int = 20              # held-out evaluation every N steps (0 = only at the end)
    save_every: int = 20              # checkpoint every N steps (0 = never)
    recompute_every: int = 20         # ADEPT: recompute unit importance every N steps
    normalize: str = "rank"           # ADEPT: unit-importance normalisation (rank, per_kind, global)
    boundary: str = "half"            # freeze_deep: train layers [0, b): half | auto (LayerTracer diagnosis) | N
    diagnosis_task: str = "bbc-topic" # diagnosis inputs: bbc-topic (few-shot BBC News topics) | context (general blocks)
    diagnosis_queries: int = 8        # composite inputs used by the diagnosis
    lora_rank: int = 8
    seed: int = 0
    bf16: str = "auto"                # auto (GPU with bf16 support) | on | off
    device: str = "auto"              # auto | cpu | cuda
    resume: bool = False              # continue the run in `out` from its last checkpoint
    overwrite: bool = False           # replace an existing run in `out`


class RunError(Exception):
    """A problem with the inputs of a run, reported as one line."""


def config_from(overrides: Dict) -> RunConfig:
    known = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise RunError(f"unknown option(s): {', '.join(unknown)}")
    if isinstance(overrides.get("layers"), list):  # TOML: layers = [7, 14]
        overrides = {**overrides, "layers": ",".join(map(str, overrides["layers"]))}
    if isinstance(overrides.get("boundary"), int):  # TOML: boundary = 12
        overrides = {**overrides, "boundary": str(overrides["boundary"])}
    cfg = RunConfig(**overrides)
    if cfg.method not in METHODS:
        raise RunError(f"unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    for name in ("block_len", "batch_size", "grad_accum", "steps", "probe_blocks", "eval_blocks", "recompute_every",
                 "diagnosis_queries"):
        if getattr(cfg, name) < 1:
            raise RunError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.bf16 not in ("auto", "on", "off"):
        raise RunError(f"bf16 must be auto, on or off, got {cfg.bf16!r}")
    if cfg.boundary not in ("half", "auto") and not cfg.boundary.isdigit():
        raise RunError(f"boundary must be half, auto or a layer count, got {cfg.boundary!r}")
    if cfg.diagnosis_task not in DIAGNOSIS_TASKS:
        raise RunError(f"diagnosis_task must be one of {', '.join(DIAGNOSIS_TASKS)}, got {cfg.diagnosis_task!r}")
    if cfg.layers and cfg.method not in LAYER_METHODS:
        raise RunError(f"--layers applies to {', '.join(LAYER_METHODS)}, not {cfg.method}")
    explicit_layers(cfg)
    return cfg


def explicit_layers(cfg) -> Optional[List[int]]:
    """The --layers choice as sorted distinct indices, or None when the method chooses."""
    if not cfg.layers:
        return None
    try:
        layers = sorted({int(x) for x in cfg.layers.split(",")})
    except ValueError:
        raise RunError(f"--layers must be comma-separated layer indices, got {cfg.layers!r}") from None
    return layers


def _device(cfg) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda: no GPU is available")
    return torch.device(cfg.device)


def _use_bf16(cfg, device) -> bool:
    supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if cfg.bf16 == "on" and not supported:
        raise RunError("--bf16 on needs a GPU with bfloat16 support")
    return cfg.bf16 == "on" or (cfg.bf16 == "auto" and supported)


def _umask_mode(mode: int) -> int:
    """`mode` as the process umask would leave it (temporary files are created private)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def _atomic_write(path: Path, write):
    """Write through a temporary file in the same folder and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _umask_mode(0o666))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _check_model_args(cfg, model):
    """Options that depend on the model: k and the freeze_deep boundary."""
    n = adapter(model).num_layers
    if cfg.method in LAYER_METHODS and not 0 < cfg.k <= n:
        raise RunError(f"k = {cfg.k} is not in [1, {n}] for a model with {n} layers")
    bad = [l for l in explicit_layers(cfg) or [] if not 0 <= l < n]
    if bad:
        raise RunError(f"--layers {bad} out of range for a model with {n} layers")
    if cfg.method == "freeze_deep" and cfg.boundary.isdigit() and not 1 <= int(cfg.boundary) <= n - 1:
        raise RunError(f"boundary {cfg.boundary} is not in [1, {n - 1}] for a model with {n} layers")


def _check_memory(cfg, model):
    """Refuse a micro-batch whose activations would not fit in the available memory."""
    c = model.config
    per_token = 4 * c.num_hidden_layers * (16 * c.hidden_size + 4 * c.intermediate_size) + 8 * c.vocab_size
    need = cfg.batch_size * cfg.block_len * per_token + 4 * 4 * sum(p.numel() for p in model.parameters())
    if _device(cfg).type == "cuda":
        available = torch.cuda.mem_get_info()[0]
    else:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) * 1024
    if need > available:
        raise RunError(f"batch_size {cfg.batch_size} x block_len {cfg.block_len} needs about {need / 2**30:.1f} GiB "
                       f"but {available / 2**30:.1f} GiB are available: lower --batch-size and raise --grad-accum")


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


class Corpora:
    """Token blocks of both corpora: general probe + held-out, domain train + held-out."""

    def __init__(self, cfg, tokenizer):
        general = data.token_blocks(data.load_texts(cfg.general), tokenizer, cfg.block_len)
        domain = data.token_blocks(data.load_texts(cfg.domain), tokenizer, cfg.block_len)
        for name, blocks in (("general", general), ("domain", domain)):
            if blocks["input_ids"].shape[0] < 2:
                raise RunError(f"the {name} corpus is shorter than two blocks of {cfg.block_len} tokens")
        g_train, g_held = data.split_blocks(general, 0.1, cfg.seed)
        d_train, d_held = data.split_blocks(domain, 0.1, cfg.seed)
        limit = lambda blocks, n: {k: v[:n] for k, v in blocks.items()}  # noqa: E731
        self.tokenizer = tokenizer
        self.general_probe = data.batches(limit(g_train, cfg.probe_blocks), cfg.batch_size)
        self.general_context = data.batches(limit(g_train, cfg.diagnosis_queries), cfg.batch_size)  # diagnosis
        self.general_eval = data.batches(limit(g_held, cfg.eval_blocks), cfg.batch_size)
        self.domain_eval = data.batches(limit(d_held, cfg.eval_blocks), cfg.batch_size)
        self.domain_train = data.batches(d_train, cfg.batch_size)


@dataclass
class Prepared:
    """What a method trains and how."""

    trainable: List[torch.nn.Parameter]
    groups: List[Dict]
    layers: List[int] = field(default_factory=list)   # expanded / trained layers
    importance: Optional[UnitImportance] = None        # ADEPT's decoupled rates
    scores: Optional[object] = None                     # LayerScores of the probe
    peft_model: Optional[torch.nn.Module] = None        # the PEFT wrapper (lora), merged before saving
    diagnosis: Optional[Diagnosis] = None               # LayerTracer diagnosis (freeze_deep --boundary auto)


def diagnosis_batches(cfg, corpora) -> List[Dict[str, torch.Tensor]]:
    """Composite inputs s_1 ⊕ s_2 for LayerTracer (SPEC §3): few-shot BBC News topic
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
    except (FileNotFoundError, ValueError) as e:
        raise RunError(f"diagnosis: {e}") from e


def _train_only(model, params) -> List[torch.nn.Parameter]:
    """Freeze every parameter of `model` except `params`; returns them as a list."""
    params = list(params)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


def prepare(model, cfg, corpora, layers=None, progress=True) -> Prepared:
    """Set up `cfg.method` on `model` (in place). `layers` replays an earlier choice (resume), else
    `cfg.layers` overrides the method's choice. A model that is already expanded (config.adept)
    keeps its copies for adept/adept_uniform_lr."""
    ad = adapter(model)
    n = ad.num_layers
    scores, peft_model, diagnosis = None, None, None
    layers = layers if layers is not None else explicit_layers(cfg)
    existing = (getattr(model.config, "adept", None) or {}).get("expanded_layers")
    reuse_copies = cfg.method in ("adept", "adept_uniform_lr") and bool(existing)
    if cfg.method in ("adept", "adept_no_expand", "adept_uniform_lr") and layers is None and not reuse_copies:
        scores = layer_importance(model, corpora.general_probe, progress=progress)
        layers = scores.select(cfg.k)
    if reuse_copies:
        layers = list(existing)
        trainable = _train_only(model, expand_layers(model, []))
    elif cfg.method in ("adept", "adept_uniform_lr", "llama_pro"):
        if cfg.method == "llama_pro" and layers is None:
            layers = [round((i + 1) * n / cfg.k) - 1 for i in range(cfg.k)]  # uniform, as LLaMA-Pro
        trainable = expand_layers(model, layers)
    elif cfg.method == "adept_no_expand":
        model.config.adept = {"expanded_layers": list(layers), "source_layers": list(layers)}
        trainable = _train_only(model, (p for l in layers for p in ad.layers[l].parameters()))
    elif cfg.method == "freeze_deep":
        if cfg.boundary == "auto":
            diagnosis = run_diagnosis(model, cfg, corpora, progress=progress)
        layers = allocate(n, "freeze_deep", diagnosis, int(cfg.boundary) if cfg.boundary.isdigit() else None)
        trainable = _train_only(model, (p for l in layers for p in ad.layers[l].parameters()))
    elif cfg.method == "full":
        layers, trainable = [], _train_only(model, model.parameters())
    else:  # lora
        from peft import LoraConfig, get_peft_model

        peft_model = get_peft_model(model, LoraConfig(
            r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        layers, trainable = [], [p for p in peft_model.parameters() if p.requires_grad]
    importance = None
    if cfg.method in ("adept", "adept_no_expand"):
        groups = param_groups(model, cfg.lr, cfg.weight_decay)
        importance = UnitImportance(model, corpora.general_probe, normalize=cfg.normalize)
    else:
        groups = [{"params": trainable, "lr": cfg.lr, "weight_decay": cfg.weight_decay}]
    return Prepared(trainable, groups, list(layers or []), importance, scores, peft_model, diagnosis)


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


def _check_out(cfg) -> Path:
    """Refuse, before anything is loaded or written, an output directory that holds another run
    (unless --resume or --overwrite) and a --resume without a checkpoint."""
    out = Path(cfg.out)
    if cfg.resume:
        if not (out / CHECKPOINT).exists():
            raise RunError(f"--resume: {out} holds no checkpoint to resume from")
    elif out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise RunError(f"{out} already holds files: pass --resume to continue that run or --overwrite to replace it")
    return out


def _prepare_out(cfg) -> Path:
    """The output directory, emptied for --overwrite; call once the inputs have been checked."""
    out = _check_out(cfg)
    if cfg.overwrite and not cfg.resume and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def run(cfg: RunConfig, progress: bool = True, log=print) -> Dict:
    """All stages of a run; returns the report (also written to `cfg.out`)."""
    started = time.time()
    device = _device(cfg)
    bf16 = _use_bf16(cfg, device)
    _check_out(cfg)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    try:
        model, tokenizer = load_model(cfg.model, device=device)
    except (FileNotFoundError, ValueError) as e:
        raise RunError(str(e)) from e
    _check_model_args(cfg, model)
    _check_memory(cfg, model)
    try:
        corpora = Corpora(cfg, tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise RunError(str(e)) from e
    out = _prepare_out(cfg)
    report = {"config": asdict(cfg), "stages": {}, "machine": {"device": str(device), "threads": torch.get_num_threads(),
                                                                 "platform": platform.platform(), "bf16": bf16}}

    def stage(name, t0, **extra):
        report["stages"][name] = {"seconds": round(time.time() - t0, 2), "peak_memory_mb": round(_peak_memory_mb(device)), **extra}

    checkpoint = torch.load(out / CHECKPOINT, weights_only=False) if cfg.resume else None
    t0 = time.time()
    base = checkpoint["base"] if checkpoint else {
        "general_loss": evaluate(model, corpora.general_eval, device, "eval general (base)", progress),
        "domain_loss": evaluate(model, corpora.domain_eval, device, "eval domain (base)", progress)}
    stage("base_eval", t0, **base)
    log(f"base model: general loss {base['general_loss']:.4f}, domain loss {base['domain_loss']:.4f}")

    t0 = time.time()
    prepared = prepare(model, cfg, corpora, layers=checkpoint["layers"] if checkpoint else None, progress=progress)
    total_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in prepared.trainable)
    stage("prepare", t0, layers=prepared.layers, trainable_parameters=n_trainable,
          trainable_fraction=n_trainable / total_params)
    if prepared.scores is not None:
        prepared.scores.to_json(out / "layer_importance.json")
        prepared.scores.plot(out / "layer_importance.png", highlight=prepared.layers)
    if prepared.diagnosis is not None:
        prepared.diagnosis.to_json(out / "diagnosis.json")
        prepared.diagnosis.plot(out / "diagnosis.png", f"LayerTracer diagnosis ({cfg.diagnosis_task})")
    log(f"{cfg.method}: {len(prepared.layers)} layers {prepared.layers}, trainable {n_trainable / 1e6:.1f}M "
        f"({n_trainable / total_params:.1%})")

    optimizer = torch.optim.AdamW(prepared.groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))
    decoupled = DecoupledLR(optimizer, prepared.importance, every=cfg.recompute_every) if prepared.importance else None
    history = {"train": [], "eval": []}
    step = 0
    if checkpoint:
        names = dict(model.named_parameters())
        for name, value in checkpoint["trainable"].items():
            names[name].data.copy_(value)
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        if decoupled:
            decoupled.load_state_dict(checkpoint["decoupled"])
        history, step = checkpoint["history"], checkpoint["step"]
        _set_rng_state(checkpoint["rng"])
        log(f"resumed at step {step}")

    def save_checkpoint():
        state = {"step": step, "layers": prepared.layers, "base": base, "history": history, "rng": _rng_state(),
                 "trainable": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "decoupled": decoupled.state_dict() if decoupled else None}
        _atomic_write(out / CHECKPOINT, lambda tmp: torch.save(state, tmp))

    t0 = time.time()
    model.train()
    batches = corpora.domain_train
    bar = tqdm(total=cfg.steps, initial=step, desc=f"training ({cfg.method})", disable=not progress)
    try:
        while step < cfg.steps:
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                batch = batches[(step * cfg.grad_accum + micro) % len(batches)]
                batch = {k: v.to(device) for k, v in batch.items()}
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = model(**batch, use_cache=False).loss / cfg.grad_accum
                loss.backward()
                loss_sum += float(loss.detach())
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(prepared.trainable, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            history["train"].append({"step": step, "loss": loss_sum, "lr": scheduler.get_last_lr()[0]})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum:.3f}")
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                history["eval"].append({"step": step,
                                        "general_loss": evaluate(model, corpora.general_eval, device, "eval general", progress),
                                        "domain_loss": evaluate(model, corpora.domain_eval, device, "eval domain", progress)})
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint()
    except KeyboardInterrupt:
        bar.close()
        save_checkpoint()
        log(f"interrupted at step {step}: checkpoint saved in {out}; continue with --resume")
        raise
    bar.close()
    stage("train", t0, steps=step, tokens=step * cfg.grad_accum * cfg.batch_size * cfg.block_len)

    t0 = time.time()
    final = {"general_loss": evaluate(model, corpora.general_eval, device, "eval general (final)", progress),
             "domain_loss": evaluate(model, corpora.domain_eval, device, "eval domain (final)", progress)}
    history["eval"].append({"step": step, **final})
    stage("final_eval", t0, **final)

    t0 = time.time()
    if decoupled:
        decoupled.remove()
        report["unit_rates"] = {"multipliers": dict(zip([u.name for u in prepared.importance.units], decoupled.multipliers)),
                                "mean_multiplier": decoupled.mean_multiplier, "recomputes": decoupled.recomputes}
        plot_unit_rates(prepared.importance.units, decoupled.multipliers, out / "unit_rates.png")
    final_model = prepared.peft_model.merge_and_unload() if prepared.peft_model is not None else model
    if cfg.method == "adept_no_expand":
        del final_model.config.adept  # nothing was expanded
    _atomic_dir(out / "model", lambda tmp: (final_model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    stage("save", t0)
    plot_loss_curves(history, base, out / "loss_curves.png", title=f"{cfg.method}: training and held-out loss")

    report.update({
        "method": cfg.method, "layers": prepared.layers, "base": base, "final": final,
        "forgetting_general_delta": final["general_loss"] - base["general_loss"],
        "gain_domain_delta": base["domain_loss"] - final["domain_loss"],
        "perplexity": {"base_general": math.exp(base["general_loss"]), "final_general": math.exp(final["general_loss"]),
                       "base_domain": math.exp(base["domain_loss"]), "final_domain": math.exp(final["domain_loss"])},
        "trainable_parameters": n_trainable, "trainable_fraction": n_trainable / total_params,
        "history": history, "plots": sorted(p.name for p in out.glob("*.png")),
        "wall_seconds": round(time.time() - started, 1)})
    _atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2)))
    _atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(markdown_report(report)))
    (out / CHECKPOINT).unlink(missing_ok=True)  # the run is complete: the model replaces it
    log(f"final: general loss {final['general_loss']:.4f} (forgetting {report['forgetting_general_delta']:+.4f}), "
        f"domain loss {final['domain_loss']:.4f} (gain {report['gain_domain_delta']:+.4f}); report: {out / 'report.md'}")
    return report


def _atomic_dir(path: Path, write):
    """Write a directory through a temporary sibling and rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        os.chmod(tmp, _umask_mode(0o777))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def markdown_report(report: Dict) -> str:
    cfg, base, final = report["config"], report["base"], report["final"]
    lines = [f"# adept_ext run: {report['method']}", "",
             f"Model `{cfg['model']}`, general corpus `{cfg['general']}`, domain corpus `{cfg['domain']}`; "
             f"{cfg['steps']} steps x {cfg['grad_accum']} x {cfg['batch_size']} x {cfg['block_len']} tokens, lr {cfg['lr']}, "
             f"seed {cfg['seed']}, device {report['machine']['device']}.", "",
             "| | general loss | general ppl | domain loss | domain ppl |", "|---|---|---|---|---|",
             f"| base | {base['general_loss']:.4f} | {math.exp(base['general_loss']):.2f} | {base['domain_loss']:.4f} | {math.exp(base['domain_loss']):.2f} |",
             f"| final | {final['general_loss']:.4f} | {math.exp(final['general_loss']):.2f} | {final['domain_loss']:.4f} | {math.exp(final['domain_loss']):.2f} |",
             "", f"Forgetting (general Δloss): {report['forgetting_general_delta']:+.4f}; "
             f"gain (domain −Δloss): {report['gain_domain_delta']:+.4f}.", "",
             f"Trainable parameters: {report['trainable_parameters'] / 1e6:.2f}M ({report['trainable_fraction']:.1%}); "
             f"layers: {report['layers']}.", "", "| stage | seconds | peak memory MB |", "|---|---|---|"]
    lines += [f"| {name} | {s['seconds']} | {s['peak_memory_mb']} |" for name, s in report["stages"].items()]
    if "unit_rates" in report:
        lines += ["", f"Per-unit learning-rate multipliers (mean {report['unit_rates']['mean_multiplier']:.3f}, "
                      f"{report['unit_rates']['recomputes']} recomputes): see `unit_rates.png`."]
    lines += ["", "Plots: " + ", ".join(f"`{name}`" for name in report["plots"]) + "."]
    return "\n".join(lines) + "\n"
