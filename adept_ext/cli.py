"""The `adept-ext` command (also `python -m adept_ext`).

    adept-ext run    [options]   probe, expand, train, evaluate, report (all stages)
    adept-ext train  [options]   the same pipeline (an already expanded --model is trained as it is)
    adept-ext probe  [options]   layer importance of --model on --general -> JSON + PNG
    adept-ext expand [options]   probe + expand the k least important layers -> HF checkpoint
    adept-ext eval   [options]   held-out general and domain loss of --model, lm-eval --benchmarks -> JSON
    adept-ext diagnose [options]  LayerTracer logit lens + layer sensitivity + layer importance -> JSON + PNG
    adept-ext continual [options] learn a sequence of tasks one after another; score matrix, AA/BWT/FWT

Options come from flags and from a TOML file (--config FILE, flat `option = value` pairs using
the flag names with underscores); flags override the file. `adept-ext COMMAND --help` lists a
command's own options. `--resume` continues the run in --out with the options it was started
with (only those whose help says "may change on --resume" may be given anew).
"""
import argparse
import difflib
import json
import logging
import math
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

from . import continual
from .errors import InputError, RunError
from .methods import method_names
from .train import METHODS, config_from, run_config_class
from .training import saved_options
from .training.config import current_names, marked, other_names
from .training.options import TOOLS

logger = logging.getLogger(__name__)
COMMANDS = ("continual", "run", "train", "probe", "expand", "eval", "diagnose")


def config_class(command: str) -> type:
    """The config of `command`, with the options of every method registered by now."""
    return continual.continual_config_class() if command == "continual" else run_config_class()


def command_options(command: str):
    """The config fields a command takes (in its config's order): every one for the runners, those
    declared for it (`option(..., commands=...)`) for a one-off command."""
    cls = config_class(command)
    return ([f.name for f in fields(cls) if command in f.metadata.get("commands", ())] if command in TOOLS
            else [f.name for f in fields(cls)])


def option_help(command: str, name: str) -> str:
    """The help text of option `name` of `command`, from its one declaration (a runner's field or
    the fields of the methods that take it), with the methods listed for --method."""
    text = next(f for f in fields(config_class(command)) if f.name == name).metadata["help"]
    if name == "method":
        text += ": " + ", ".join(method_names(sequence=True) if command == "continual" else METHODS)
    cls = config_class(command)
    if name in marked(cls, "resumable") and name not in marked(cls, "one_way") and "resume" in command_options(command):
        text += "; may change on `--resume`"
    return text


def both_ways(command: str, name: str) -> bool:
    """Whether a switch also has a --no- form (every training switch; not those declared `one_way`,
    --resume and --overwrite, and the ablations that are themselves a `no`)."""
    return name not in marked(config_class(command), "one_way") and "no_" not in name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adept-ext", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        summary = __doc__.split(f"adept-ext {name}")[1].split("\n")[0].split("  ")[-1].strip()
        p = sub.add_parser(name, help=summary, description=f"adept-ext {name}: {summary}")
        p.add_argument("--config", metavar="FILE", help="TOML file with options (flags override it)")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        defaults = config_class(name)(out=f"runs/{name}")
        renamed = other_names(config_class(name), "former_names")
        for option in command_options(name):
            flag = "--" + option.replace("_", "-")
            flags = [flag] + ["--" + old.replace("_", "-") for old, new in renamed.items() if new == option]
            default = getattr(defaults, option)
            text = option_help(name, option).replace("`", "")
            if isinstance(default, bool):
                action = argparse.BooleanOptionalAction if both_ways(name, option) else "store_true"
                p.add_argument(*flags, action=action, default=None,
                               help=f"{text} (default: {'on' if default else 'off'})")
            else:
                p.add_argument(*flags, type=type(default), default=None, metavar=type(default).__name__.upper(),
                               help=f"{text} (default: {default})")
    return parser


def options_table(command: str) -> str:
    """The Markdown table of `command`'s options, as docs/cli.md holds it (`tools/write_cli_docs.py`)."""
    defaults = config_class(command)(out=f"runs/{command}")
    rows = ["| option | default | what |", "|---|---|---|"]
    for option in command_options(command):
        default, flag = getattr(defaults, option), option.replace("_", "-")
        if isinstance(default, bool):
            shown = f"{'on' if default else 'off'}" + ("" if both_ways(command, option) else " (a switch)")
            flag = f"`--{flag}`" + (f" / `--no-{flag}`" if both_ways(command, option) else "")
        else:
            shown, flag = ('"" (none)' if default == "" else f"`{default}`"), f"`--{flag}`"
        rows.append(f"| {flag} | {shown} | {option_help(command, option)} |")
    return "\n".join(rows) + "\n"


def _unknown_keys(values, allowed, source: str, cls):
    """RunError naming the first unknown option of `values` and the option it most likely means (its
    name in other tools, `option(..., known_as=...)`, or the closest option name)."""
    aliases = other_names(cls, "known_as")
    for key in values:
        if key not in allowed:
            guess = aliases.get(key) or next(iter(difflib.get_close_matches(key, allowed, n=1)), None)
            hint = f"; did you mean {guess!r}?" if guess in allowed else ""
            raise RunError(f"{source}: unknown option {key!r}{hint}")


def _check_numbers(values):
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise RunError(f"{key} must be a finite number, got {value}")


def resolve_config(args):
    """The checked config of `args.command`: defaults, then the TOML file, then flags; with
    --resume, the run's own saved options, overridden only where that is safe."""
    command, cls = args.command, config_class(args.command)
    names = [f.name for f in fields(cls)]
    values = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise RunError(f"--config {path}: no such file")
        try:
            values.update(current_names(tomllib.loads(path.read_text()), cls))
        except tomllib.TOMLDecodeError as e:
            raise RunError(f"--config {path}: {e}") from e
        _unknown_keys(values, names, f"--config {path}", cls)
    values.update({n: getattr(args, n) for n in command_options(command) if getattr(args, n) is not None})
    given = set(values) if command in ("run", "train", "continual") else set()  # another method's: refused
    values.setdefault("out", f"runs/{command}")
    if values.get("resume"):
        saved = current_names(saved_options(Path(values["out"]), command), cls)
        # an option the run's run.json lacks (added since) ran at its default
        defaults = {f.name: f.default for f in fields(cls) if f.default is not None}
        saved = {**{k: defaults[k] for k in values if k in defaults and k not in saved}, **saved}
        resumable = marked(cls, "resumable")
        conflicts = [k for k, v in values.items() if k not in resumable and k in saved and saved[k] != v
                     and not (k == "out")]
        if conflicts:
            k = conflicts[0]
            raise RunError(f"--resume: --{k.replace('_', '-')} {values[k]} differs from the run's own {k} "
                           f"({saved[k]!r}); only {', '.join(sorted(set(resumable) - set(marked(cls, 'one_way'))))} "
                           "may change on resume")
        values = {**{k: v for k, v in saved.items() if k in names}, **values}
        values["overwrite"] = False
    _check_numbers(values)
    return (continual.config_from if command == "continual" else config_from)(values, given=given)


def _probe_or_expand(cfg, command, progress):
    from .data import corpus_blocks, data_workers, split_views
    from .adept.expand import expand_layers
    from .models import load_model
    from .adept.probe import layer_importance
    from .training import check_out, device_for, prepare_out

    check_out(cfg, command)
    try:
        model, tokenizer = load_model(cfg.model, device=device_for(cfg), attn_implementation=cfg.attn_implementation)
        train, _ = split_views(corpus_blocks(cfg.general, tokenizer, cfg.max_length, data_workers(cfg)), cfg.seed,
                               "the general corpus")
    except (FileNotFoundError, InputError) as e:
        raise RunError(str(e)) from e
    out = prepare_out(cfg, command)
    probe = list(train.first(cfg.probe_blocks).batches(cfg.batch_size))
    scores = layer_importance(model, probe, progress=progress)
    chosen = scores.select(min(cfg.k, len(scores.scores)))
    scores.to_json(out / "layer_importance.json", selected=chosen)
    scores.plot(out / "layer_importance.png", label=f"the {len(chosen)} least important")
    logger.info(f"layer importance (Δloss when bypassed) on {scores.tokens} tokens; least important: {chosen}; "
          f"written to {out / 'layer_importance.json'} and .png")
    if command == "expand":
        trainable = expand_layers(model, chosen)
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
        n_trainable = sum(p.numel() for p in trainable)
        logger.info(f"expanded model ({model.config.num_hidden_layers} layers, {n_trainable / 1e6:.1f}M "
              f"trainable) written to {out / 'model'}")


def _load(cfg, command):
    """(model, corpora, output directory) after every input has been checked."""
    from .models import load_model
    from .data import Corpora
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
    from .adept.probe import layer_importance
    from .training.one_domain import run_diagnosis

    model, corpora, out = _load(cfg, "diagnose")
    scores = layer_importance(model, corpora.general_probe, progress=progress)
    diagnosis = run_diagnosis(model, cfg, corpora, importance=scores, progress=progress)
    diagnosis.to_json(out / "diagnosis.json")
    diagnosis.plot(out / "diagnosis.png", f"LayerTracer diagnosis of {cfg.model} ({cfg.diagnosis_task})")
    lens, js = diagnosis.lens, diagnosis.sensitivity.js
    logger.info(f"task particle: layer {lens.task_particle}; execution layers (Ratio > 0): {lens.execution_layers}")
    logger.info(f"most context-sensitive layers: {sorted(range(len(js)), key=lambda i: -js[i])[:4]}; "
          f"ADEPT's {cfg.k} least important layers: {scores.select(min(cfg.k, len(js)))}")
    logger.info(f"freeze_deep --boundary auto trains layers [0, {boundary_from(diagnosis)}); "
          f"written to {out / 'diagnosis.json'} and .png")


def _evaluate(cfg, progress):
    from .evaluation import harness
    from .training import device_for, evaluate

    model, corpora, out = _load(cfg, "eval")
    device = device_for(cfg)
    result = {"model": cfg.model,
              "general_loss": evaluate(model, corpora.general_eval, device, "eval general", progress),
              "domain_loss": evaluate(model, corpora.domain_eval, device, "eval domain", progress)}
    benchmarks = harness.for_run(cfg, model, corpora.tokenizer, out / "benchmark_samples.jsonl", None, 0, "model",
                                 logger.info)
    if benchmarks:
        result["benchmarks"] = benchmarks
        (out / "eval.md").write_text(f"# adept_ext eval: `{cfg.model}`\n\nGeneral loss {result['general_loss']:.4f}, "
                                     f"domain loss {result['domain_loss']:.4f}.\n\nBenchmarks (lm-evaluation-harness "
                                     f"{benchmarks['lm_eval_version']}):\n\n{harness.markdown_table(benchmarks['tasks'])}")
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    logger.info(f"general loss {result['general_loss']:.4f}, domain loss {result['domain_loss']:.4f}; "
          f"written to {out / 'eval.json'}")


def main(argv=None) -> int:
    from transformers.utils import logging as hf_logging

    args = build_parser().parse_args(argv)
    progress = not args.no_progress
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    package = logging.getLogger("adept_ext")  # the library logs; the command shows its INFO messages on stdout
    handler, level, propagate = logging.StreamHandler(sys.stdout), package.level, package.propagate
    handler.setFormatter(logging.Formatter("%(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False
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
    finally:  # --no-progress and the handler are for this command only, also when main() is called in-process
        if bars_were_on:
            hf_logging.enable_progress_bar()
        package.removeHandler(handler)
        package.setLevel(level)
        package.propagate = propagate
    return 0


if __name__ == "__main__":
    sys.exit(main())
