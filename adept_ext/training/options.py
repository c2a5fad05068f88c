"""The options every runner takes (one domain or a task sequence), and their checks."""
import math
import os
from dataclasses import dataclass, fields
from typing import Collection, Dict, Optional

import torch

from .. import merge_back as merge_back_module, parallel
from ..models import check_attention, quantize
from ..evaluation import harness, lm_eval_tasks
from ..data.truncation import MODES as TRUNCATION_MODES
from ..errors import RunError
from ..lm_loss import LOSS_IMPLEMENTATIONS
from ..methods import create, method_names
from ..methods.base import REGISTRY, option
from ..optim import check_optimizer
from .config import check_types, current_names, foreign_options
from .tracking import backends_of

FROZEN_DTYPES = ("auto", "bfloat16", "float32", "nf4")
TOOLS = ("probe", "expand", "eval", "diagnose")  # the one-off commands, each taking the options marked for it


@dataclass
class TrainOptions:
    """Options of every runner (one domain or a task sequence), with their defaults and help texts.
    A method's own options are not here: they are its config's fields (`methods`), added to a
    runner's config by `with_method_options`."""

    model: str = option("smollm2-135m", commands=TOOLS, known_as=("model_name_or_path",), help=(
        "local HF checkpoint directory or embedded model name (smollm2-135m)"))
    out: str = option("runs/run", commands=TOOLS, affects_results=False, known_as=("output_dir",),
                      help="output directory")
    method: str = option("adept", help="adaptation method")
    max_length: int = option(128, commands=TOOLS, former_names=("block_len",),
                             known_as=("block_size", "seq_len", "cutoff_len"), help=(
        "the longest sequence in tokens (TRL's max_length; the old --block-len / block_len still name it): text is "
        "cut into blocks of this many tokens, an instruction example or conversation is one sequence of at most "
        "this many"))
    batch_size: int = option(4, commands=TOOLS, known_as=("per_device_train_batch_size",),
                             help="blocks per micro-batch")
    grad_accum: int = option(1, known_as=("gradient_accumulation_steps",), help="micro-batches per optimizer step")
    steps: int = option(40, resumable=True, known_as=("max_steps", "num_steps"),
                        help="optimizer steps (per task in a sequence)")
    lr: float = option(3e-4, known_as=("learning_rate",), help="base learning rate (AdamW)")
    warmup_steps: int = option(4, known_as=("warmup",), help="linear warmup steps before the cosine decay")
    weight_decay: float = option(0.01, help="AdamW weight decay")
    optim: str = option("adamw_torch", help=(
        "optimizer of the trainable weights (Hugging Face's `optim` names): `adamw_torch` (AdamW, float32 moments: "
        "8 bytes of state per trainable parameter), `adamw_8bit` or its alias `adamw_bnb_8bit` (bitsandbytes' "
        "blockwise 8-bit AdamW: the same update with both moments in 8 bits and a float32 scale "
        "per 256 elements, about 2 bytes; a tensor of fewer than 4096 elements and the embedding weights keep "
        "float32 moments, as in Hugging Face's Trainer), `paged_adamw_8bit` (the same, its state of tensors of "
        "100k elements or more in CUDA unified memory that pages out to the host under GPU memory pressure; on "
        "the CPU it is adamw_8bit); every group's own rate (ADEPT's per-unit rates) is honoured; the 8-bit ones "
        "need `pip install 'adept-ext[quantization]'` and are not offered with --parallel fsdp2"))
    max_grad_norm: float = option(1.0, help="gradient clipping norm (0 = off)")
    logging_steps: int = option(1, resumable=True, affects_results=False, help=(
        "read the training loss from the device every N steps (and at the last) and log the mean over those steps, "
        "as Hugging Face's `logging_steps`: report.json's history, the progress bar and `--report-to` get one entry "
        "per N steps (tokens/s over them, the grad norm and lr of the step); 1 logs every step"))
    gradient_checkpointing: bool = option(False, resumable=True, help=(
        "recompute each decoder layer's activations in the backward pass (Hugging Face's non-reentrant activation "
        "checkpointing): less memory, the same losses, about one more forward per step"))
    attn_implementation: str = option("auto", help=(
        "transformers' attention backend: `auto` (the one transformers picks for the model: sdpa, or eager for "
        "Gemma 2), `sdpa` (PyTorch's scaled_dot_product_attention), `eager`, or `flash_attention_2` (needs the "
        "flash-attn package and a CUDA GPU); a backend the model or the machine cannot run is refused before "
        "anything loads"))
    loss_implementation: str = option("auto", resumable=True, help=(
        "next-token loss of training and evaluation: `auto` (the fused linear cross-entropy on the LM head, which "
        "never forms the batch × sequence × vocabulary logits, when the head is a plain linear map; else Hugging "
        "Face's, with the reason in the log and report.json), `fused` (refused when the head is not plain), `hf` "
        "(the model's own loss on full logits)"))
    compile: bool = option(False, resumable=True, help=(
        "`torch.compile` each decoder layer in place for the training steps (the copies an expansion adds too; "
        "evaluation runs eager); the first steps pay the compilation; not with `--parallel fsdp2` yet (refused)"))
    mix_general: float = option(0.0, help=(
        "share of the training blocks drawn from the general corpus's training split (never its held-out or probe "
        "blocks), spread evenly over the batches: general-data mixing against forgetting (0 = off; in continual: "
        "of every task's blocks)"))
    probe_blocks: int = option(8, commands=("probe", "expand", "diagnose"),
                               help="general blocks used to probe layers and score units")
    eval_blocks: int = option(16, commands=("eval", "diagnose"), help="held-out blocks per corpus for evaluation")
    drift_tokens: int = option(512, affects_results=False, help=(
        "the drift signal: the mean KL divergence of the model's next-token distributions from the base model's "
        "at the first N labelled positions of the held-out general rows (all of them where they hold fewer), at "
        "every evaluation (`kl_to_base` in report.json and to --report-to); the base's are kept on the host in "
        "float32, N × vocabulary × 4 bytes (512 positions: 100 MB at a 49k vocabulary); 0 = off"))
    save_every: int = option(20, resumable=True, affects_results=False, help="checkpoint every N steps (0 = never)")
    seed: int = option(0, commands=TOOLS, help="random seed (data split and order)")
    bf16: str = option("auto", help="bf16 autocast: auto (GPUs that support it), on (also on the CPU), off")
    frozen_dtype: str = option("auto", help=(
        "dtype the weights that do not train are held in during a task: auto (bfloat16 under bf16 autocast, except "
        "with fsdp2), bfloat16 (needs bf16 autocast; not with fsdp2), float32, or nf4 (QLoRA's 4-bit NormalFloat "
        "through bitsandbytes, double quantisation, for the frozen linear layers of the decoder: LoRA's base, "
        "ADEPT's and LLaMA-Pro's originals, freeze_deep's deep block; the other frozen weights as auto; not with "
        "fsdp2, --compile or a method that trains every weight); trainable weights and gradients stay float32 (AdamW's "
        "state too, unless --optim is 8-bit). The exact weights are kept on the host wherever holding rounds them, so "
        "nothing saved carries a rounding error: the runners hold them from the load on, evaluate the model as the "
        "steps see it (continual's rows: bfloat16, not 4 bits) and merge and save on the host"))
    device: str = option("auto", commands=TOOLS, resumable=True, help="auto, cpu or cuda")
    parallel: str = option("ddp", help=(
        "under torchrun: ddp (every rank holds the model) or fsdp2 (parameters, gradients and optimizer state "
        "sharded per decoder layer while training; not o_lora, deal, eoupct)"))
    resume: bool = option(False, resumable=True, one_way=True, affects_results=False,
                          help="continue the run in --out from its last checkpoint")
    overwrite: bool = option(False, commands=TOOLS, resumable=True, one_way=True, affects_results=False,
                             help="replace an existing run in --out")
    data_workers: int = option(0, resumable=True, affects_results=False, help=(
        "processes tokenising a file, folder or saved-dataset corpus (0 = the CPU count, at most 8)"))
    dataloader_num_workers: int = option(0, resumable=True, affects_results=False, help=(
        "processes that build the training batches ahead of the steps (Hugging Face's dataloader_num_workers: "
        "torch DataLoader workers; pinned memory on a GPU): 0 builds them in the training process; the batches and "
        "their order are the same for any count; with --streaming at most 1 (one process reads a stream in order)"))
    chat_template: str = option("", help=(
        "a Jinja chat template file for conversational data (messages, alpaca, sharegpt records) instead of the "
        "tokenizer's (needed when it has none)"))
    train_on_prompt: bool = option(False, help=(
        "train instruction and conversational data on every token, not only the completions / assistant turns"))
    truncation_mode: str = option("keep_end", help=(
        "an instruction example or conversation longer than --max-length (TRL's truncation_mode): keep_end keeps "
        "the end of a prompt (the answer is never cut: an example whose answer and EOS do not fit with a prompt "
        "token is skipped) and a conversation's last turns, from the start of a user or system turn where one fits; "
        "keep_start keeps the start of a prompt and a conversation's first tokens; an example left without a token "
        "to train on is skipped, counted in report.json's data, and a file whose every example is skipped is an "
        "error; text is cut into blocks and never truncated"))
    packing: bool = option(False, help=(
        "pack whole documents (text) or examples (instruction, conversational) into the training rows of "
        "--max-length by best-fit decreasing, a document longer than a row split into rows first, with position "
        "ids restarting at each document and attention confined to it (TRL's padding-free bfd packing); held-out, "
        "probe and diagnosis rows stay one padded row per document or example; an architecture whose attention "
        "would cross documents is refused; not with --streaming"))
    report_to: str = option("none", resumable=True, affects_results=False, help=(
        "live tracking (Hugging Face's names): `none`, or a comma-separated list of `tensorboard` (event files in "
        "`--out`/runs), `mlflow` (a local file store in `--out`/mlruns unless `MLFLOW_TRACKING_URI` is set), "
        "`wandb`, `trackio`; training loss, lr, grad norm, tokens/s, peak memory and ADEPT's rate statistics every "
        "`--logging-steps` steps, every held-out evaluation, and in `continual` each task's scores and the running "
        "AA / BWT; rank 0 only; a backend that is not installed is an error before anything trains"))


@dataclass
class BenchmarkOptions:
    """Benchmark evaluation through EleutherAI's lm-evaluation-harness (`adept_ext.evaluation.harness`), named as
    lm-eval's own command names them; a runner's options class inherits it (`RunOptions`)."""

    benchmarks: str = option("", commands=("eval",), help=(
        "lm-evaluation-harness task names, comma-separated (lm-eval's --tasks: its built-in tasks such as "
        "hellaswag or arc_easy, or the tasks of --include-path), scored in-process on the in-memory model: each "
        "metric with its stderr and item count in the report (docs/evaluation.md); needs `pip install "
        "\"adept-ext[lm-eval]\"`"))
    include_path: str = option("", commands=("eval",), help=(
        "a folder of lm-eval YAML task files (lm-eval's --include_path; a task over local files, `dataset_path: "
        "json` with `data_files`, runs offline); when it holds every task of --benchmarks, lm-eval's built-in "
        "tasks are not indexed. A YAML file's `!function` tags import and run Python files of the folder (warned "
        "at start): use only folders you trust"))
    num_fewshot: int = option(-1, commands=("eval",),
                              help="examples in context per item (lm-eval's --num_fewshot); -1: each task's own")
    limit: int = option(-1, commands=("eval",), help=(
        "at most N items per task (lm-eval's --limit: a quick look, its stderr grows as N shrinks); -1: every item"))
    apply_chat_template: bool = option(False, commands=("eval",), help=(
        "render each item with the tokenizer's chat template (lm-eval's --apply_chat_template; for Instruct "
        "models)"))
    fewshot_as_multiturn: bool = option(False, commands=("eval",), help=(
        "the few-shot examples as alternating chat turns (lm-eval's --fewshot_as_multiturn, which its command "
        "turns on with the chat template); needs --apply-chat-template"))
    log_samples: bool = option(False, commands=("eval",), affects_results=False, help=(
        "write every evaluated item (prompt, responses, metrics) as JSON lines to `--out` (lm-eval's --log_samples): "
        "benchmark_samples.jsonl (eval), benchmark_samples_base.jsonl and benchmark_samples_final.jsonl (run)"))


@dataclass
class MergeBackOptions:
    """Merging back toward the start after training (`adept_ext.merge_back`, docs/methods.md §7); both
    runners' configs inherit it."""

    merge_back: str = option("", help=(
        "after training (continual: after each task), move every weight the task changed back toward where it "
        "started, θ₀ + α·(θ − θ₀) (model averaging with the start: run's base model, continual's model after the "
        "previous task; θ₀ the weight, a LoRA's base layer, an expansion's function-preserving copy): α in [0, 1] "
        "(0: the start, 1: the trained model), or (run only) `auto`: the largest α of 0, 0.1, …, 1 whose general "
        "held-out loss rises at most --max-forgetting above the base's, the front (α → general and domain Δloss) "
        "in report.json and merge_back.png; what is evaluated, benchmarked and saved is the merged model; "
        "default: off"))
    merge_back_schedule: str = option("uniform", help=(
        "with --merge-back: `uniform` (one α for every weight) or `lines` (LiNeS: α grows linearly with depth "
        "from --merge-back-min at the embeddings and the first layer to α at the last layer and the head)"))
    merge_back_min: float = option(0.0, help="with --merge-back and --merge-back-schedule lines: α of the bottom")
    max_forgetting: float = option(0.0, help=(
        "with --merge-back auto: the general held-out Δloss from the base the chosen α may reach (nats)"))


def merge_back_alpha(cfg) -> Optional[float]:
    """--merge-back's α (None: auto, or off)."""
    return None if cfg.merge_back in ("", "auto") else float(cfg.merge_back)


def check_merge_back(cfg, auto: bool):
    """RunError for --merge-back options that do not fit: α outside [0, 1], `auto` where the runner does
    not choose (`auto` False), an unknown schedule, a bottom α above α, or its companions without it
    (`auto`'s bound without auto)."""
    if cfg.merge_back == "auto" and not auto:
        raise RunError("--merge-back auto chooses α on a single-domain run's held-out rows: give continual a number "
                       "in [0, 1]")
    if cfg.merge_back not in ("", "auto"):
        try:
            alpha = float(cfg.merge_back)
        except ValueError:
            alpha = math.nan
        if not 0 <= alpha <= 1:
            raise RunError(f"merge_back must be a number in [0, 1] or auto, got {cfg.merge_back!r}")
    if cfg.merge_back_schedule not in merge_back_module.SCHEDULES:
        raise RunError(f"merge_back_schedule must be one of {', '.join(merge_back_module.SCHEDULES)}, "
                       f"got {cfg.merge_back_schedule!r}")
    if not 0 <= cfg.merge_back_min <= 1:
        raise RunError(f"merge_back_min must be in [0, 1], got {cfg.merge_back_min}")
    if not math.isfinite(cfg.max_forgetting):
        raise RunError(f"max_forgetting must be a finite number, got {cfg.max_forgetting}")
    companions = [name for name in ("merge_back_schedule", "merge_back_min", "max_forgetting")
                  if getattr(cfg, name) != getattr(MergeBackOptions, name)]  # its default given (a full TOML): fine
    if companions and not cfg.merge_back:
        raise RunError(f"--{companions[0].replace('_', '-')} needs --merge-back")
    if cfg.max_forgetting and cfg.merge_back != "auto":
        raise RunError("--max-forgetting bounds the choice of --merge-back auto: it needs --merge-back auto")
    if cfg.merge_back_min and cfg.merge_back_schedule != "lines":
        raise RunError("--merge-back-min is the bottom α of --merge-back-schedule lines: it needs that schedule")
    alpha = merge_back_alpha(cfg)
    if cfg.merge_back_schedule == "lines" and alpha is not None and alpha < cfg.merge_back_min:
        raise RunError(f"--merge-back {alpha} is below --merge-back-min {cfg.merge_back_min}: LiNeS keeps the bottom "
                       "closest to the start")


def as_recorded_today(recorded: Dict, defaults: Dict) -> Dict:
    """A run's recorded `result_options` read with today's options (`defaults`: `result_options` of
    a default config of the same runner and method): an option it lacks, added after it ran, at its
    default (an option is added with the behaviour before it as its default), one no longer offered
    left out, a former name (`former_names`) read as the name now. A changed default still tells the run
    apart: its recorded value is the old one."""
    recorded = current_names(recorded, TrainOptions)
    return {k: recorded.get(k, v) for k, v in defaults.items()}


def check_benchmark_options(cfg: BenchmarkOptions):
    """RunError for bad benchmark options (`harness.check_benchmarks`), before anything loads."""
    harness.check_benchmarks(harness.task_list(cfg.benchmarks), cfg.include_path, cfg.limit, cfg.num_fewshot,
                             cfg.apply_chat_template, cfg.fewshot_as_multiturn)


def options_from(cls, overrides: Dict, sequence: bool = False, given: Collection[str] = ()):
    """`cls` (a runner's config, `with_method_options`) from a dict of options, with every value
    checked: the runner's here, every method's by building its config (MethodError), the chosen
    method by creating it once. An option in `given` (what the user gave: flags, TOML keys) that
    only other methods take is refused (`foreign_options`). RunError on bad input."""
    overrides = current_names(overrides, cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise RunError(f"unknown option(s): {', '.join(unknown)}")
    check_types(cls, overrides)
    cfg = cls(**overrides)
    foreign_options(cls, cfg.method, given)
    for name in ("max_length", "batch_size", "grad_accum", "steps", "logging_steps", "probe_blocks", "eval_blocks"):
        if getattr(cfg, name) < 1:
            raise RunError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("warmup_steps", "save_every", "weight_decay", "max_grad_norm", "dataloader_num_workers",
                 "drift_tokens"):
        if not getattr(cfg, name) >= 0:
            raise RunError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise RunError(f"lr must be a finite number > 0, got {cfg.lr}")
    if cfg.max_length < 2:
        raise RunError(f"max_length must be >= 2 (a sequence needs a next token to score), got {cfg.max_length}")
    if not 0 <= cfg.mix_general < 1:
        raise RunError(f"mix_general must be in [0, 1), got {cfg.mix_general}")
    if cfg.loss_implementation not in LOSS_IMPLEMENTATIONS:
        raise RunError(f"loss_implementation must be one of {', '.join(LOSS_IMPLEMENTATIONS)}, "
                       f"got {cfg.loss_implementation!r}")
    if cfg.data_workers < 0:
        raise RunError(f"data_workers must be >= 0 (0 = the CPU count), got {cfg.data_workers}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise RunError(f"device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.bf16 not in ("auto", "on", "off"):
        raise RunError(f"bf16 must be auto, on or off, got {cfg.bf16!r}")
    if cfg.frozen_dtype not in FROZEN_DTYPES:
        raise RunError(f"frozen_dtype must be one of {', '.join(FROZEN_DTYPES)}, got {cfg.frozen_dtype!r}")
    if cfg.frozen_dtype == "bfloat16" and cfg.parallel == "fsdp2":
        raise RunError("--frozen-dtype bfloat16 with --parallel fsdp2 is not supported (FSDP2 all-gathers each layer's "
                       "parameters in one dtype); use --frozen-dtype auto or float32 with fsdp2")
    if cfg.frozen_dtype == "nf4":
        if cfg.parallel == "fsdp2" or cfg.compile:
            raise RunError(f"--frozen-dtype nf4 with {'--parallel fsdp2' if cfg.parallel == 'fsdp2' else '--compile'} "
                           "is not supported (bitsandbytes' 4-bit weights are neither sharded by FSDP2 nor traced "
                           "by torch.compile here); use --parallel ddp without --compile")
        quantize.check_installed()
    if cfg.parallel not in parallel.ENGINES:
        raise RunError(f"parallel must be one of {', '.join(parallel.ENGINES)}, got {cfg.parallel!r}")
    if cfg.parallel == "fsdp2" and parallel.launched_world() < 2:
        raise RunError("--parallel fsdp2 shards the model over the processes of torchrun: launch with "
                       "`torchrun --nproc-per-node N` (N >= 2), or leave --parallel at ddp for one process")
    check_optimizer(cfg.optim, sharded=cfg.parallel == "fsdp2")  # also: bitsandbytes installed
    if cfg.compile and cfg.parallel == "fsdp2":
        raise RunError("--compile with --parallel fsdp2 is not supported yet (FSDP2's all-gather hooks would be "
                       "traced inside each compiled layer); use --compile with ddp, or fsdp2 without --compile")
    if cfg.chat_template and not os.path.isfile(cfg.chat_template):
        raise RunError(f"--chat-template {cfg.chat_template}: no such file")
    if cfg.truncation_mode not in TRUNCATION_MODES:
        raise RunError(f"truncation_mode must be one of {', '.join(TRUNCATION_MODES)}, got {cfg.truncation_mode!r}")
    backends_of(cfg.report_to)  # an unknown or missing backend: an error before anything trains
    if isinstance(cfg, BenchmarkOptions):
        check_benchmark_options(cfg)
        if sequence:  # adept_ext's own tasks as benchmarks: the items held out with this run's seed
            lm_eval_tasks.check_seed(harness.task_list(cfg.benchmarks), cfg.seed)
    check_attention(cfg.attn_implementation, "cpu" if cfg.device == "cpu" or not torch.cuda.is_available() else "cuda")
    method = create(cfg.method, cfg, sequence=sequence)  # MethodError (a RunError) for the method's own options
    for name in (method_names(sequence=True) if sequence else method_names(single_domain=True)):
        REGISTRY[name].config_class.from_options(cfg)  # the other methods' options: MethodError for a bad value
    if cfg.frozen_dtype == "nf4" and method.trains_every_weight:
        raise RunError(f"--frozen-dtype nf4 holds the linear weights that do not train in 4 bits, and {cfg.method} "
                       "trains every one: choose a method that freezes weights (lora, adept, llama_pro, ...) or "
                       "another --frozen-dtype")
    if cfg.parallel == "fsdp2" and not method.shardable:
        raise RunError(f"method {cfg.method} cannot train a model sharded by FSDP2 (its hooks need the whole "
                       "weights); use --parallel ddp")
    return cfg


