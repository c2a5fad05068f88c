"""EleutherAI's lm-evaluation-harness (lm-eval) in-process on an in-memory model: benchmark scores that
can be compared with the numbers users see elsewhere (docs/evaluation.md).

`evaluate_benchmarks(model, tokenizer, tasks)` wraps the model in lm-eval's `HFLM` and runs
`lm_eval.simple_evaluate` on lm-eval task names (its built-in tasks, or YAML task files in an
`include_path` folder, which run offline over local files). Around the call it keeps what a training
run depends on: the caller's Python, numpy, torch (and CUDA) random states (lm-eval reseeds all three
with its own seeds, which it keeps for its own work), and each module's train/eval mode (HFLM calls
`model.eval()`). Under torchrun rank 0 evaluates while the other ranks wait (`WAIT`) and then receive
its results, so every rank returns the same. lm-eval is an optional extra (`pip install
"adept-ext[lm-eval]"`); `check_benchmarks` turns a missing package, an unknown task, a task folder
without YAML or a bad limit into one RunError before anything loads.
"""
import difflib
import functools
import importlib.util
import json
import logging
import random
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .. import parallel
from ..models import held
from . import lm_eval_tasks, paired
from ..errors import InputError, RunError

INSTALL = 'pip install "adept-ext[lm-eval]"'
MODULE = "lm_eval"
# How long the other ranks wait for rank 0's evaluation, in a gloo group of its own (so the training group's
# timeout, 30 minutes for gloo and 10 for NCCL by default, does not apply); a longer evaluation fails the run.
WAIT = timedelta(hours=24)
logger = logging.getLogger(__name__)


def task_list(benchmarks: str) -> List[str]:
    """The task names of a comma-separated `--benchmarks` value (empty: none)."""
    return [t.strip() for t in benchmarks.split(",") if t.strip()]


def check_installed():
    """RunError when lm-eval is not installed."""
    if importlib.util.find_spec(MODULE) is None:
        raise RunError(f"--benchmarks runs EleutherAI's lm-evaluation-harness, which is not installed: {INSTALL}")


@functools.lru_cache(maxsize=8)
def task_manager(tasks: tuple, include_path: str):
    """lm-eval's TaskManager that knows `tasks`: the `include_path` folder and that of adept_ext's own
    tasks among them (`lm_eval_tasks.BUILTIN`, written on demand) alone when they hold them all
    (indexing lm-eval's thousands of built-in YAML files takes about 10 s on 2 cores), else lm-eval's
    built-in tasks too. RunError naming an unknown task (and the closest known name), or the package
    that one of adept_ext's tasks reads its data from."""
    from lm_eval.tasks import TaskManager

    try:
        paths = [p for p in (include_path, *lm_eval_tasks.builtin_folders(tasks)) if p]
    except (FileNotFoundError, InputError) as e:
        raise RunError(f"--benchmarks: {e}") from e
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=paths or None)
    for name in tasks:
        if name not in manager.all_tasks:
            guess = difflib.get_close_matches(name, [*manager.all_tasks, *lm_eval_tasks.BUILTIN], n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            where = f"lm-eval's tasks or the YAML files of {include_path}" if include_path else "lm-eval's tasks"
            raise RunError(f"--benchmarks: unknown task {name!r} (not among {where}){hint}")
    return manager


def check_benchmarks(tasks: Sequence[str], include_path: str = "", limit: int = -1, num_fewshot: int = -1,
                     apply_chat_template: bool = False, fewshot_as_multiturn: bool = False):
    """RunError for what would make an evaluation fail or mean nothing, before anything loads: lm-eval
    missing, an `include_path` that is no folder of YAML task files, a limit of 0 or below -1 (-1: every
    item), num_fewshot below -1 (-1: each task's own), multi-turn few-shot without a chat template, an
    unknown task; a warning naming the YAML files of `include_path` whose `!function` tags run Python.
    Nothing is checked (or imported) when no task is asked for."""
    if limit == 0 or limit < -1:
        raise RunError(f"limit must be >= 1 items per task (or -1 for every item), got {limit}")
    if num_fewshot < -1:
        raise RunError(f"num_fewshot must be >= 0 (or -1 for each task's own), got {num_fewshot}")
    if fewshot_as_multiturn and not apply_chat_template:
        raise RunError("--fewshot-as-multiturn turns the few-shot examples into chat turns: it needs "
                       "--apply-chat-template (as lm-eval's)")
    if include_path:
        folder = Path(include_path)
        if not folder.is_dir():
            raise RunError(f"--include-path {include_path}: no such folder")
        files = sorted(folder.rglob("*.yaml"))
        if not files:
            raise RunError(f"--include-path {include_path}: no YAML task file (*.yaml) in it")
        code = [str(f) for f in files if "!function" in f.read_text(errors="replace")]
        if code:  # lm-eval's YAML tag that imports a Python file beside the YAML and runs its function
            logger.warning("--include-path %s: %s name Python functions (!function), which lm-eval imports and "
                           "runs as this process: use only task folders you trust", include_path, ", ".join(code))
    if tasks:
        check_installed()
        task_manager(tuple(tasks), include_path)


@contextmanager
def kept_state(model: torch.nn.Module):
    """Inside: anything may reseed the random generators or switch modules to eval mode; on exit the
    Python, numpy, torch (CPU and, when initialised, every CUDA device) random states and every
    module's train/eval mode are what they were."""
    modes = [(m, m.training) for m in model.modules()]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if cuda else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda:
            torch.cuda.set_rng_state_all(states[3])
        for module, training in modes:
            module.training = training


def _plain(value):
    """A metric value as plain JSON: a float, or None where lm-eval has none (its stderr "N/A")."""
    return float(value) if isinstance(value, (int, float, np.number)) and not isinstance(value, bool) else None


def scores_of(results: Dict) -> Dict:
    """{task: {"n": items evaluated, "n_total": items in the task, "num_fewshot": k, "metrics":
    {metric: {"value", "stderr"}}}} from `simple_evaluate`'s result, plain JSON. A metric is named as
    lm-eval names it without its filter ("acc"), or "metric,filter" where a filter other than lm-eval's
    "none" made it ("exact_match,strict-match")."""
    scores = {}
    for task, entry in results["results"].items():
        metrics = {}
        for key, value in entry.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else key
            metrics[name] = {"value": _plain(value), "stderr": _plain(entry.get(f"{metric}_stderr,{filter_name}"))}
        counts = results.get("n-samples", {}).get(task, {})
        scores[task] = {"n": counts.get("effective"), "n_total": counts.get("original"),
                        "num_fewshot": results.get("n-shot", {}).get(task), "metrics": metrics}
    return scores


def _evaluate_here(model, tokenizer, tasks, include_path, num_fewshot, limit, batch_size, apply_chat_template,
                   fewshot_as_multiturn, samples_path):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import handle_non_serializable

    started = time.time()
    quiet = logging.getLogger(MODULE)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # HFLM warns on every call that it was given a model object, as it is meant to be
    try:
        device = next(model.parameters()).device  # under autocast where `run` holds weights in bfloat16
        with kept_state(model), torch.no_grad(), held.autocast_for(model, device):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            results = lm_eval.simple_evaluate(
                model=lm, tasks=list(tasks), task_manager=task_manager(tuple(tasks), include_path),
                num_fewshot=None if num_fewshot < 0 else num_fewshot, limit=None if limit < 0 else limit,
                apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
                log_samples=True)  # each item's scores, for the paired tests (`compare`)
    finally:
        quiet.setLevel(level)
    if samples_path is not None:
        with open(samples_path, "w") as f:
            for task, items in results["samples"].items():
                for item in items:
                    f.write(json.dumps({"task": task, **item}, default=handle_non_serializable) + "\n")
    return {"lm_eval_version": lm_eval.__version__, "seconds": round(time.time() - started, 2),
            "tasks": scores_of(results), "items": items_of(results["samples"], results.get("group_subtasks", {}))}


def items_of(samples: Dict, groups: Dict) -> Dict:
    """{task: {"doc_ids": [...], "metrics": {metric: [value per item]}}} from lm-eval's logged samples,
    items in doc_id order, metrics named as `scores_of` names them; metrics whose per-item value is not a
    number (corpus-level ones) are left out. A group of `groups` ({group: [its tasks]}, lm-eval's
    "group_subtasks") gets its tasks' items one after the other ("TASK/DOC_ID"), for the metrics they share."""
    items = {}
    for task, logged in samples.items():
        by_filter: Dict[str, List] = {}
        for sample in logged:
            by_filter.setdefault(sample["filter"], []).append(sample)
        entry = {"doc_ids": None, "metrics": {}}
        for filter_name, rows in by_filter.items():
            rows = sorted(rows, key=lambda r: r["doc_id"])
            entry["doc_ids"] = entry["doc_ids"] or [r["doc_id"] for r in rows]
            for metric in rows[0]["metrics"]:
                values = [_plain(r.get(metric)) for r in rows]
                if all(v is not None for v in values):
                    entry["metrics"][metric if filter_name == "none" else f"{metric},{filter_name}"] = values
        items[task] = entry
    for group, tasks in groups.items():
        if not tasks or not all(t in items for t in tasks):
            continue
        shared = set.intersection(*(set(items[t]["metrics"]) for t in tasks))
        items[group] = {"doc_ids": [f"{t}/{i}" for t in tasks for i in items[t]["doc_ids"]],
                        "metrics": {m: [v for t in tasks for v in items[t]["metrics"][m]]
                                    for m in sorted(shared)}}
    return items


def evaluate_benchmarks(model: torch.nn.Module, tokenizer, tasks: Sequence[str], include_path: str = "",
                        num_fewshot: int = -1, limit: int = -1, batch_size: int = 1, apply_chat_template: bool = False,
                        fewshot_as_multiturn: bool = False, samples_path: Optional[Path] = None) -> Dict:
    """lm-eval's scores of `model` (a Hugging Face causal LM, or a PEFT model around one, where it is)
    on `tasks` (lm-eval task names; `include_path`: a folder of YAML task files), `num_fewshot` examples
    in context (-1: each task's own), at most `limit` items per task (-1: all), as lm-eval's
    `--apply-chat-template` and `--fewshot-as-multiturn` do; `samples_path`: a JSONL file of every item
    (prompt, responses, metrics), written by rank 0. Returns `{"lm_eval_version", "seconds", "tasks":
    scores_of(...)}` on every rank; the caller's random states and module modes are kept (`kept_state`).
    RunError for bad arguments (`check_benchmarks`), before the model is touched."""
    check_benchmarks(tasks, include_path, limit, num_fewshot, apply_chat_template, fewshot_as_multiturn)
    args = (model, tokenizer, tasks, include_path, num_fewshot, limit, batch_size, apply_chat_template,
            fewshot_as_multiturn, samples_path)
    if parallel.world_size() == 1:
        return _evaluate_here(*args)
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=WAIT)  # every rank waits here, not in the training group
    try:
        box, error = [None], None
        if parallel.is_main():
            try:
                box[0] = _evaluate_here(*args)
            except Exception as e:  # the other ranks must not wait for results that never come
                box[0], error = {"error": f"{type(e).__name__}: {e}"}, e
        dist.broadcast_object_list(box, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    if error is not None:
        raise error
    if "error" in box[0]:
        raise RunError(f"the benchmark evaluation failed on rank 0: {box[0]['error']}")
    return box[0]


def tracked(scores: Optional[Dict]) -> Dict[str, float]:
    """{"benchmarks/TASK/METRIC": value} of an `evaluate_benchmarks` result (for `--report-to`; {} for None)."""
    if scores is None:
        return {}
    return {f"benchmarks/{task}/{metric}": m["value"] for task, entry in scores["tasks"].items()
            for metric, m in entry["metrics"].items() if m["value"] is not None}


def for_run(cfg, model, tokenizer, samples_path: Path, tracker, step: int, label: str, log) -> Optional[Dict]:
    """`evaluate_benchmarks` as the runners call it: with the options of `cfg` (a config with the fields
    of `training.BenchmarkOptions`), None when it asks for no task; the scores are logged and sent to
    `tracker` (`benchmarks/TASK/METRIC` at `step`), every item to `samples_path` under `--log-samples`."""
    tasks = task_list(cfg.benchmarks)
    if not tasks:
        return None
    scores = evaluate_benchmarks(model, tokenizer, tasks, cfg.include_path, cfg.num_fewshot, cfg.limit, cfg.batch_size,
                                 cfg.apply_chat_template, cfg.fewshot_as_multiturn,
                                 samples_path if cfg.log_samples else None)
    values = tracked(scores)
    if tracker is not None:
        tracker.log(values, step)
    log(f"benchmarks ({label}): " + ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in values.items()))
    return scores


def markdown_table(scores: Dict) -> str:
    """The Markdown table of `scores_of`'s result: task, metric, value ± stderr, items."""
    rows = ["| task | metric | value | stderr | items |", "|---|---|---|---|---|"]
    for task, entry in scores.items():
        for metric, m in entry["metrics"].items():
            stderr = "" if m["stderr"] is None else f"{m['stderr']:.4f}"
            value = "" if m["value"] is None else f"{m['value']:.4f}"
            rows.append(f"| {task} | {metric} | {value} | {stderr} | {'' if entry['n'] is None else entry['n']} |")
    return "\n".join(rows) + "\n"


def compare(base: Dict, final: Dict) -> Dict:
    """{task: {metric: {"base", "final", "delta", "stderr", "beyond_2se", "paired"}}} of two
    `evaluate_benchmarks` results on the same tasks: delta = final - base, stderr = sqrt(se_base^2 +
    se_final^2) (the two scores taken as independent, which overstates it for the same items: a
    conservative test), whether |delta| > 2 stderr (None where a stderr is missing), and `paired`:
    `paired.paired_difference` of the two models' per-item values (McNemar's exact test, a paired
    bootstrap interval; None where either result lacks the items, or they are not the same items)."""
    compared = {}
    for task, entry in final["tasks"].items():
        base_items, final_items = base.get("items", {}).get(task), final.get("items", {}).get(task)
        same_items = base_items is not None and final_items is not None and \
            base_items["doc_ids"] == final_items["doc_ids"]
        for metric, f in entry["metrics"].items():
            b = base["tasks"].get(task, {}).get("metrics", {}).get(metric)
            if b is None or b["value"] is None or f["value"] is None:
                continue
            delta = f["value"] - b["value"]
            missing = b["stderr"] is None or f["stderr"] is None
            stderr = None if missing else (b["stderr"] ** 2 + f["stderr"] ** 2) ** 0.5
            both = same_items and metric in base_items["metrics"] and metric in final_items["metrics"]
            compared.setdefault(task, {})[metric] = {
                "base": b["value"], "final": f["value"], "delta": delta, "stderr": stderr,
                "beyond_2se": None if stderr is None else abs(delta) > 2 * stderr,
                "paired": paired.paired_difference(base_items["metrics"][metric], final_items["metrics"][metric])
                if both else None}
    return compared


def _yes_no(flag: Optional[bool]) -> str:
    return "" if flag is None else ("yes" if flag else "no")


def comparison_table(compared: Dict) -> str:
    """The Markdown table of `compare`'s result: the independent-samples rule beside the paired tests
    (McNemar's p for 0/1 metrics, the paired bootstrap 95 % interval, the verdict at 5 %)."""
    rows = ["| task | metric | base | final | difference | combined stderr | beyond 2 stderr | McNemar p | "
            "paired 95 % interval | real (paired, 5 %) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for task, metrics in compared.items():
        for metric, c in metrics.items():
            stderr = "" if c["stderr"] is None else f"{c['stderr']:.4f}"
            p = c.get("paired") or {}
            p_value = "" if p.get("p_value") is None else f"{p['p_value']:.3g}"
            interval = "" if not p else f"[{p['interval'][0]:+.4f}, {p['interval'][1]:+.4f}]"
            rows.append(f"| {task} | {metric} | {c['base']:.4f} | {c['final']:.4f} | {c['delta']:+.4f} | {stderr} | "
                        f"{_yes_no(c['beyond_2se'])} | {p_value} | {interval} | {_yes_no(p.get('significant'))} |")
    return "\n".join(rows) + "\n"


def rows_table(rows: Sequence) -> str:
    """The Markdown table of several `evaluate_benchmarks` results on the same tasks, given as (label,
    result) pairs: one row each, one column per task and metric, value ± stderr."""
    columns = [(task, metric) for task, entry in rows[0][1]["tasks"].items() for metric in entry["metrics"]]
    lines = ["| after | " + " | ".join(f"{task} ({metric})" for task, metric in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for label, scores in rows:
        cells = []
        for task, metric in columns:
            m = scores["tasks"].get(task, {}).get("metrics", {}).get(metric, {"value": None, "stderr": None})
            cells.append("" if m["value"] is None else f"{m['value']:.4f}"
                         + ("" if m["stderr"] is None else f" ± {m['stderr']:.4f}"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
