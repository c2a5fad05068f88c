"""The `adept-ext` command (also `python -m adept_ext`).

    adept-ext run    [options]   probe, expand, train, evaluate, report (all stages)
    adept-ext train  [options]   the same pipeline (an already expanded --model is trained as it is)
    adept-ext probe  [options]   layer importance of --model on --general -> JSON + PNG
    adept-ext expand [options]   probe + expand the k least important layers -> HF checkpoint
    adept-ext eval   [options]   held-out general and domain loss of --model -> JSON
    adept-ext diagnose [options]  LayerTracer logit lens + layer sensitivity + layer importance -> JSON + PNG
    adept-ext continual [options] learn a sequence of tasks one after another; score matrix, AA/BWT/FWT

Options come from flags and from a TOML file (--config FILE, flat `option = value` pairs using
the flag names with underscores); flags override the file. `adept-ext COMMAND --help` lists a
command's own options. `--resume` continues the run in --out with the options it was started
with (only --steps, --save-every, --eval-every, --device and --data-workers may change).
"""
import argparse
import difflib
import json
import math
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

from . import continual
from .errors import InputError, RunError
from .methods import method_names
from .train import METHODS, RunConfig, config_from
from .training import saved_options

COMMON = ("model", "out", "block_len", "batch_size", "seed", "device", "overwrite")
OPTIONS = {  # the options each command shows and takes; run/train/continual take all of their config's
    "probe": (*COMMON, "general", "k", "probe_blocks"),
    "expand": (*COMMON, "general", "k", "probe_blocks"),
    "eval": (*COMMON, "general", "domain", "eval_blocks"),
    "diagnose": (*COMMON, "general", "domain", "k", "probe_blocks", "eval_blocks", "diagnosis_task",
                 "diagnosis_queries"),
}
CONFIGS = {"continual": continual.ContinualConfig, **{name: RunConfig for name in
                                                   ("run", "train", "probe", "expand", "eval", "diagnose")}}
SAFE_ON_RESUME = {"steps", "save_every", "eval_every", "device", "data_workers", "gradient_checkpointing", "report_to",
                  "loss_implementation", "compile", "logging_steps",
                  "resume", "overwrite"}
ALIASES = {"learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "rank": "lora_rank",
           "block_size": "block_len", "seq_len": "block_len", "max_length": "block_len",
           "gradient_accumulation_steps": "grad_accum", "per_device_train_batch_size": "batch_size",
           "output_dir": "out", "model_name_or_path": "model", "warmup": "warmup_steps"}

HELP = {
    "model": "local HF checkpoint directory or embedded model name (smollm2-135m)",
    "general": "general-domain corpus: text file, folder, JSONL with 'text', or bbc-news / python-docs",
    "domain": "domain corpus to adapt to (same forms as --general)",
    "out": "output directory",
    "method": "adaptation method",
    "k": "number of layers to expand (adept, llama_pro; per task: adept_seq, llama_pro_seq) or train (adept_no_expand)",
    "layers": "comma-separated layers to expand or train instead of the method's choice (overrides k)",
    "placement": "where adept, adept_uniform_lr and adept_no_expand put their k layers: importance (ADEPT), "
                 "uniform (LLaMA-Pro's spacing), domain_aware, plasticity, depth (below --boundary), spread "
                 "(least important per depth block); see adept_ext/placement.py",
    "streaming": "read the corpora as streams through Hugging Face datasets: corpus order, no cache, only "
                 "what the run consumes is read (for corpora too large to tokenise up front)",
    "data_workers": "processes tokenising a file, folder or saved-dataset corpus (0 = the CPU count, at most 8)",
    "block_len": "tokens per block",
    "batch_size": "blocks per micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "steps": "optimizer steps",
    "lr": "base learning rate (AdamW)",
    "warmup_steps": "linear warmup steps before the cosine decay",
    "weight_decay": "AdamW weight decay",
    "max_grad_norm": "gradient clipping norm (0 = off)",
    "logging_steps": "read the training loss from the device every N steps (and at the last) and log the mean over "
                     "those steps (Hugging Face's logging_steps): the report's history, the progress bar and "
                     "--report-to get one entry per N steps; 1 logs every step",
    "gradient_checkpointing": "recompute each decoder layer's activations in the backward pass instead of keeping "
                              "them (Hugging Face's non-reentrant activation checkpointing): less memory, the "
                              "same losses, about one more forward per step",
    "probe_blocks": "general blocks used to probe layers and score units",
    "eval_blocks": "held-out blocks per corpus for evaluation",
    "eval_every": "held-out evaluation every N steps (0 = only at the end)",
    "save_every": "checkpoint every N steps (0 = never)",
    "recompute_every": "ADEPT: recompute unit importance every N steps",
    "normalize": "ADEPT: unit-importance normalisation: rank, per_kind or global",
    "boundary": "freeze_deep: train layers [0, b) with b = half, auto (from a LayerTracer diagnosis) or a number",
    "diagnosis_task": "LayerTracer inputs: bbc-topic (few-shot BBC News topic classification) or context "
                      "(general blocks, first half as context)",
    "diagnosis_queries": "composite inputs (queries) of the LayerTracer diagnosis",
    "lora_rank": "LoRA rank (lora, seq_lora, o_lora, per_task, replay with replay_base lora)",
    "tasks": "comma-separated tasks in order: text files/folders, JSONL with 'text' (text task) or with "
             "'prompt'/'answer' (instruction task), python-docs, python-source, bbc-topic, sms-spam, rt-sentiment, "
             "parl-language; or builtin (python-docs, python-source, bbc-topic) or classification (bbc-topic, "
             "sms-spam, rt-sentiment, parl-language)",
    "replay_fraction": "replay: share of every earlier task's training blocks mixed into a later task",
    "replay_base": "replay: on top of seq_full (full) or seq_lora (lora)",
    "o_lora_lambda": "o_lora: weight of the orthogonality penalty between the new and the earlier LoRA A's",
    "o_lora_penalty": "o_lora: the penalty's norm: fro2 (the paper's squared Frobenius norm of A_i A_t^T) or l1 "
                      "(the public code's entrywise L1)",
    # deal
    "deal_rank": "deal: LoRA rank",
    "deal_variant": "deal: paper (the paper's filtered and updated factors, merged after each task) or public_code "
                    "(the authors' code: frozen B, 2-D Haar θ on A, an MLP on the LoRA activations; not mergeable, "
                    "the adapter is saved beside the base model)",
    "deal_filter": "deal: knowledge-retention filter: wavelet (the paper's heat-kernel network) or haar (the public "
                   "code's one-level Haar DWT)",
    "deal_filter_on": "deal: LoRA matrices that are filtered and updated: ab, a or b",
    "deal_scales": "deal: number of heat-kernel scales of the wavelet filter",
    "deal_new_rank": "deal: rank of the fresh zero-initialised LoRA term the new task learns beside the filtered "
                     "factors (0: none, the filter and update only)",
    "deal_lambda1": "deal: weight of the retention penalty ‖θ_retain‖_a^a",
    "deal_a": "deal: exponent a of the retention penalty (a >= b)",
    "deal_lambda2": "deal: weight of the update penalty ‖θ_update‖_b^b",
    "deal_b": "deal: exponent b of the update penalty (>= 1)",
    # eoupct
    "eoupct_student": "eoupct: student: lora (one rank-r adapter kept across tasks) or full (every parameter)",
    "eoupct_rank": "eoupct: LoRA rank of the student",
    "eoupct_lora_alpha": "eoupct: LoRA alpha of the student, scaling alpha / rank (the public code's 32: scaling 8 "
                         "at rank 4; 0: 2 x rank, scaling 2)",
    "eoupct_target_modules": "eoupct: the student's projections: gate (the MLP gate projections, as the public "
                             "code's gate_proj; every projection where the experts are fused), all (every attention "
                             "and MLP projection of the family) or comma-separated names",
    "eoupct_teacher": "eoupct: the teacher: base (the model before the first task, as the paper and the public code), "
                      "task_start (the model at the start of the current task) or auto (base; task_start for the "
                      "full student)",
    "eoupct_proxy": "eoupct: knowledge proxy: gumbel (teacher-generated pseudo-sequence), embeds (the soft prompt "
                    "as inputs_embeds, as the public code) or none",
    "eoupct_proxy_len": "eoupct: soft prompt length (4-32)",
    "eoupct_gen_steps": "eoupct: positions the teacher generates from the prompt (gumbel)",
    "eoupct_tau": "eoupct: Gumbel-softmax temperature",
    "eoupct_alpha": "eoupct: virtual step size (theta_virt = theta - alpha g_new)",
    "eoupct_lambda": "eoupct: weight of the cos^2 penalty against earlier tasks' proxy gradients",
    "eoupct_proxy_every": "eoupct: optimise the soft prompt every N optimizer steps",
    "eoupct_proxy_steps": "eoupct: prompt ascent steps each time",
    "eoupct_proxy_lr": "eoupct: Adam learning rate of the soft prompt",
    "eoupct_no_virtual": "eoupct ablation: optimise the prompt at theta instead of the virtual step",
    "eoupct_no_conflict": "eoupct ablation: no conflict correction",
    "eoupct_where": "eoupct: project the optimizer's update (update, exact with AdamW) or only the gradients (grad)",
    "eoupct_target": "eoupct: L_pre on the last hidden states (hidden) or on the logits (logits)",
    "eoupct_directions": "eoupct: directions added to the null-space memory per task",
    "eoupct_memory": "eoupct: memory directions per task: delta (the task's parameter change) or gpm (the "
                     "strongest directions of the task's gradients)",
    "seed": "random seed (data split and order)",
    "bf16": "bf16 autocast: auto (GPUs that support it), on (also on the CPU), off",
    "frozen_dtype": "dtype the weights that do not train are held in during a task: auto (bfloat16 under bf16 "
                    "autocast, except with fsdp2), bfloat16 or float32; trainable weights and AdamW stay float32",
    "device": "auto, cpu or cuda",
    "parallel": "under torchrun: ddp (every rank holds the model) or fsdp2 (parameters, gradients and "
                "optimizer state sharded per decoder layer while training; not o_lora, deal, eoupct)",
    "attn_implementation": "transformers' attention backend: sdpa (PyTorch's scaled_dot_product_attention), "
                           "eager, or flash_attention_2 (needs the flash-attn package and a CUDA GPU)",
    "loss_implementation": "next-token loss: auto (the fused linear cross-entropy on the LM head, no batch x "
                           "sequence x vocabulary logits, when the head is a plain linear map; else Hugging Face's), "
                           "fused (an error when the head is not plain), or hf (the model's own loss on full logits)",
    "compile": "torch.compile each decoder layer for the training steps (evaluation runs eager); the first "
               "steps pay the compilation; off by default",
    "mix_general": "share of the training blocks drawn from the general corpus's training split (never its "
                   "held-out or probe blocks), spread evenly over the batches: general-data mixing against "
                   "forgetting (0 = off; in continual: of every task's blocks)",
    "report_to": "live tracking of losses, lr, grad norm, tokens/s, peak memory and every evaluation: none, or "
                 "a comma-separated list of tensorboard (event files in --out/runs), mlflow (--out/mlruns unless "
                 "MLFLOW_TRACKING_URI is set), wandb, trackio; rank 0 only",
    "resume": "continue the run in --out from its last checkpoint",
    "overwrite": "replace an existing run in --out",
}


def command_options(command: str):
    """The config fields a command takes (in its config's order)."""
    names = [f.name for f in fields(CONFIGS[command])]
    return [n for n in names if n in OPTIONS[command]] if command in OPTIONS else names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adept-ext", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in CONFIGS:
        summary = __doc__.split(f"adept-ext {name}")[1].split("\n")[0].split("  ")[-1].strip()
        p = sub.add_parser(name, help=summary, description=f"adept-ext {name}: {summary}")
        p.add_argument("--config", metavar="FILE", help="TOML file with options (flags override it)")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        defaults = CONFIGS[name](out=f"runs/{name}")
        for option in command_options(name):
            flag = "--" + option.replace("_", "-")
            default = getattr(defaults, option)
            text = HELP[option]
            if option == "method":
                text += ": " + ", ".join(method_names(sequence=True) if name == "continual" else METHODS)
            if isinstance(default, bool):
                p.add_argument(flag, action="store_true", default=None, help=text)
            else:
                p.add_argument(flag, type=type(default), default=None, metavar=type(default).__name__.upper(),
                               help=f"{text} (default: {default})")
    return parser


def _unknown_keys(values, allowed, source: str):
    """RunError naming the first unknown option of `values` and the option it most likely means."""
    for key in values:
        if key not in allowed:
            guess = ALIASES.get(key) or next(iter(difflib.get_close_matches(key, allowed, n=1)), None)
            hint = f"; did you mean {guess!r}?" if guess in allowed else ""
            raise RunError(f"{source}: unknown option {key!r}{hint}")


def _check_numbers(values):
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise RunError(f"{key} must be a finite number, got {value}")


def resolve_config(args):
    """The checked config of `args.command`: defaults, then the TOML file, then flags; with
    --resume, the run's own saved options, overridden only where that is safe."""
    command, cls = args.command, CONFIGS[args.command]
    names = [f.name for f in fields(cls)]
    values = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise RunError(f"--config {path}: no such file")
        try:
            values.update(tomllib.loads(path.read_text()))
        except tomllib.TOMLDecodeError as e:
            raise RunError(f"--config {path}: {e}") from e
        _unknown_keys(values, names, f"--config {path}")
    values.update({n: getattr(args, n) for n in command_options(command) if getattr(args, n) is not None})
    values.setdefault("out", f"runs/{command}")
    if values.get("resume"):
        saved = saved_options(Path(values["out"]), command)
        conflicts = [k for k, v in values.items() if k not in SAFE_ON_RESUME and k in saved and saved[k] != v
                     and not (k == "out")]
        if conflicts:
            k = conflicts[0]
            raise RunError(f"--resume: --{k.replace('_', '-')} {values[k]} differs from the run's own {k} "
                           f"({saved[k]!r}); only {', '.join(sorted(SAFE_ON_RESUME - {'resume', 'overwrite'}))} "
                           "may change on resume")
        values = {**{k: v for k, v in saved.items() if k in names}, **values}
        values["overwrite"] = False
    _check_numbers(values)
    return continual.config_from(values) if command == "continual" else config_from(values)


def _probe_or_expand(cfg, command, progress):
    from .data import corpus_blocks, split_views
    from .expand import expand_layers
    from .models import load_model
    from .probe import layer_importance
    from .training import check_out, data_workers, device_for, prepare_out

    check_out(cfg, command)
    try:
        model, tokenizer = load_model(cfg.model, device=device_for(cfg), attn_implementation=cfg.attn_implementation)
        train, _ = split_views(corpus_blocks(cfg.general, tokenizer, cfg.block_len, data_workers(cfg)), cfg.seed,
                               "the general corpus")
    except (FileNotFoundError, InputError) as e:
        raise RunError(str(e)) from e
    out = prepare_out(cfg, command)
    probe = list(train.first(cfg.probe_blocks).batches(cfg.batch_size))
    scores = layer_importance(model, probe, progress=progress)
    chosen = scores.select(min(cfg.k, len(scores.scores)))
    scores.to_json(out / "layer_importance.json", selected=chosen)
    scores.plot(out / "layer_importance.png", label=f"the {len(chosen)} least important")
    print(f"layer importance (Δloss when bypassed) on {scores.tokens} tokens; least important: {chosen}; "
          f"written to {out / 'layer_importance.json'} and .png")
    if command == "expand":
        trainable = expand_layers(model, chosen)
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
        n_trainable = sum(p.numel() for p in trainable)
        print(f"expanded model ({model.config.num_hidden_layers} layers, {n_trainable / 1e6:.1f}M "
              f"trainable) written to {out / 'model'}")


def _load(cfg, command):
    """(model, corpora, output directory) after every input has been checked."""
    from .models import load_model
    from .train import Corpora
    from .training import check_out, device_for, prepare_out

    check_out(cfg, command)
    try:
        model, tokenizer = load_model(cfg.model, device=device_for(cfg), attn_implementation=cfg.attn_implementation)
        corpora = Corpora(cfg, tokenizer)
    except (FileNotFoundError, InputError) as e:
        raise RunError(str(e)) from e
    return model, corpora, prepare_out(cfg, command)


def _diagnose(cfg, progress):
    from .lens import boundary_from
    from .probe import layer_importance
    from .train import run_diagnosis

    model, corpora, out = _load(cfg, "diagnose")
    scores = layer_importance(model, corpora.general_probe, progress=progress)
    diagnosis = run_diagnosis(model, cfg, corpora, importance=scores, progress=progress)
    diagnosis.to_json(out / "diagnosis.json")
    diagnosis.plot(out / "diagnosis.png", f"LayerTracer diagnosis of {cfg.model} ({cfg.diagnosis_task})")
    lens, js = diagnosis.lens, diagnosis.sensitivity.js
    print(f"task particle: layer {lens.task_particle}; execution layers (Ratio > 0): {lens.execution_layers}")
    print(f"most context-sensitive layers: {sorted(range(len(js)), key=lambda i: -js[i])[:4]}; "
          f"ADEPT's {cfg.k} least important layers: {scores.select(min(cfg.k, len(js)))}")
    print(f"freeze_deep --boundary auto trains layers [0, {boundary_from(diagnosis)}); "
          f"written to {out / 'diagnosis.json'} and .png")


def _evaluate(cfg, progress):
    from .training import device_for, evaluate

    model, corpora, out = _load(cfg, "eval")
    device = device_for(cfg)
    result = {"model": cfg.model,
              "general_loss": evaluate(model, corpora.general_eval, device, "eval general", progress),
              "domain_loss": evaluate(model, corpora.domain_eval, device, "eval domain", progress)}
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    print(f"general loss {result['general_loss']:.4f}, domain loss {result['domain_loss']:.4f}; "
          f"written to {out / 'eval.json'}")


def main(argv=None) -> int:
    from transformers.utils import logging as hf_logging

    args = build_parser().parse_args(argv)
    progress = not args.no_progress
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        cfg = resolve_config(args)
        if args.command in ("run", "train"):
            from .train import run

            run(cfg, progress=progress)
        elif args.command == "continual":
            continual.run(cfg, progress=progress)
        elif args.command in ("probe", "expand"):
            _probe_or_expand(cfg, args.command, progress)
        elif args.command == "diagnose":
            _diagnose(cfg, progress)
        else:
            _evaluate(cfg, progress)
    except RunError as e:
        print(f"adept-ext: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:  # --no-progress is for this command only, also when main() is called in-process
        if bars_were_on:
            hf_logging.enable_progress_bar()
    return 0


if __name__ == "__main__":
    sys.exit(main())
