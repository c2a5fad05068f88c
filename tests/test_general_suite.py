"""The general suite offline (adept_ext.evaluation.general_suite): each task's items, its prompts as lm-eval's own task
of that name builds them (its YAML templates and helper functions applied to the raw fields of OLMo's docs),
and the harness's per-item accuracy equal to the argmax of log-likelihoods computed directly with the model,
on 50 items of every task; the group adept_general as the item-weighted mean."""
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tiny_models import write_run_workspace

from adept_ext.evaluation import general_suite, harness

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks.hellaswag.utils import preprocess as hellaswag_preprocess  # noqa: E402
from lm_eval.tasks.medmcqa.utils_medmcqa import doc_to_text as medmcqa_text  # noqa: E402
from lm_eval.tasks.medqa.preprocess_medqa import doc_to_text as medqa_4options_text  # noqa: E402
from lm_eval.tasks.winogrande import preprocess_winogrande as winogrande  # noqa: E402
from lm_eval.utils import apply_template  # noqa: E402

LIMIT = 50
COUNTS = {"adept_arc_easy": 570, "adept_arc_challenge": 299, "adept_hellaswag": 10042, "adept_piqa": 1838,
          "adept_winogrande": 1267, "adept_boolq": 3270, "adept_openbookqa": 500, "adept_sciq": 1000,
          "adept_commonsense_qa": 1221, "adept_social_iqa": 1954, "adept_medqa": 1273, "adept_medmcqa": 4183}
TASKS_DIR = Path(lm_eval.__file__).parent / "tasks"
YAML = {"arc": "arc/arc_easy.yaml", "piqa": "piqa/piqa.yaml", "boolq": "super_glue/boolq/default.yaml",
        "openbookqa": "openbookqa/openbookqa.yaml", "sciq": "sciq/sciq.yaml", "siqa": "siqa/siqa.yaml",
        "commonsense_qa": "commonsense_qa/default.yaml"}


def lm_eval_yaml(key):
    return yaml.safe_load((TASKS_DIR / YAML[key]).read_text())


def render(config, doc):
    """lm-eval's prompt, choices and gold of `doc` (in its dataset's fields) under a task's YAML."""
    def field(template):
        return doc[template] if isinstance(template, str) and template in doc else template

    text = field(config["doc_to_text"])
    text = apply_template(text, doc) if "{{" in text else text
    choices = config["doc_to_choice"]
    choices = eval(apply_template(choices, doc)) if isinstance(choices, str) and "{{" in choices else choices
    target = field(config["doc_to_target"])
    target = apply_template(target, doc) if isinstance(target, str) and "{{" in target else target
    target = choices.index(target) if isinstance(target, str) and target in choices else int(target)
    return text, list(choices), target


def question_of(query):
    return query.removeprefix("Question: ").removesuffix("\nAnswer:")


def lettered(question, choices, gold):
    """The HF fields of a question with lettered choices (ARC, OpenBookQA, CommonsenseQA)."""
    labels = list("ABCDE"[:len(choices)])
    return {"question": question, "question_stem": question, "choices": {"text": choices, "label": labels},
            "answerKey": labels[gold]}


def lm_eval_prompt(name, doc):
    """(contexts, continuations, gold) lm-eval scores for one raw OLMo doc of task `name`: one context and a
    continuation per choice, or (winogrande) a context per choice and one continuation."""
    if name in ("adept_arc_easy", "adept_arc_challenge"):
        text, choices, gold = render(lm_eval_yaml("arc"), lettered(question_of(doc["query"]), doc["choices"],
                                                                     doc["gold"]))
    elif name == "adept_hellaswag":  # OLMo's query is lm-eval's process_docs query; its endings, not all cleaned
        assert hellaswag_preprocess(doc["query"]) == doc["query"]
        text, choices, gold = doc["query"], [hellaswag_preprocess(c) for c in doc["choices"]], doc["gold"]
    elif name == "adept_piqa":
        text, choices, gold = render(lm_eval_yaml("piqa"), doc)
    elif name == "adept_winogrande":
        contexts = winogrande.doc_to_choice(doc)
        return contexts, [" " + winogrande.doc_to_target(doc)] * len(contexts), winogrande.doc_to_text(doc)
    elif name == "adept_boolq":
        passage, question = doc["query"].rsplit("\nQuestion: ", 1)
        text, choices, gold = render(lm_eval_yaml("boolq"), {"passage": passage,
                                                             "question": question.removesuffix("?\nAnswer:"),
                                                             "label": int(doc["choices"][doc["gold"]] == "yes")})
    elif name == "adept_openbookqa":
        text, choices, gold = render(lm_eval_yaml("openbookqa"), lettered(question_of(doc["query"]), doc["choices"],
                                                                            doc["gold"]))
    elif name == "adept_sciq":
        text, choices, gold = render(lm_eval_yaml("sciq"), doc)
    elif name == "adept_commonsense_qa":
        text, choices, gold = render(lm_eval_yaml("commonsense_qa"), lettered(question_of(doc["query"]),
                                                                                doc["choices"], doc["gold"]))
    elif name == "adept_social_iqa":
        text, choices, gold = render(lm_eval_yaml("siqa"), doc)
    elif name == "adept_medqa":  # lm-eval's medqa_4options prompt, extended by MedQA's fifth option
        four = medqa_4options_text({"sent1": doc["question"], **{f"ending{i}": doc["choices"][i] for i in range(4)}})
        text = four.removesuffix("Answer:") + f"E. {doc['choices'][4]}\nAnswer:"
        choices, gold = list("ABCDE"), doc["choices"].index(doc["answer"])  # the answer text, not OLMo's gold
    else:
        text, choices, gold = medmcqa_text(doc), list("ABCD"), doc["cop"]
    return [text] * len(choices), [" " + c for c in choices], gold


def test_every_task_has_its_items_with_a_gold_answer():
    for name, count in COUNTS.items():
        items = general_suite.items(name)
        assert len(items) == count, name
        width = [len(i.get("choices", i.get("contexts"))) for i in items]
        assert all(0 <= i["gold"] < w for i, w in zip(items, width)), name
    assert set(general_suite.GROUPS["adept_general"]) | set(general_suite.GROUPS["adept_medical"]) == set(COUNTS)


@pytest.mark.parametrize("name", list(COUNTS))
def test_prompts_choices_and_gold_are_lm_evals(name):
    """Every item, as lm-eval's task of that name would build it from the same data."""
    task = general_suite.TASKS[name]
    for doc, item in zip(general_suite.olmo_docs(task), general_suite.items(name)):
        contexts, continuations, gold = lm_eval_prompt(name, doc)
        if name == "adept_winogrande":
            assert (item["contexts"], " " + item["continuation"], item["gold"]) == (contexts, continuations[0], gold)
        else:
            assert (item["query"], [" " + c for c in item["choices"]], item["gold"]) == \
                (contexts[0], continuations, gold)


@torch.no_grad()
def loglikelihood(model, tokenizer, context, continuation):
    """log p(continuation | context) as lm-eval's HFLM splits the pair (the tokens of context + continuation
    after those of the context alone; a trailing space of the context moves to the continuation)."""
    spaces = len(context) - len(context.rstrip(" "))
    context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    n_context = len(tokenizer(context, add_special_tokens=False).input_ids)
    logp = model(torch.tensor([whole[:-1]])).logits.float().log_softmax(-1)[0]
    return sum(logp[i - 1, whole[i]].item() for i in range(n_context, len(whole)))


def test_the_harness_scores_each_item_as_a_direct_computation(tmp_path_factory, monkeypatch):
    """`adept_general` and `adept_medical` at --limit 50 on the tiny model: each item's acc (and acc_norm,
    the argmax of the log-likelihood per character of the choice) equals the argmax computed directly from
    the model's log-likelihoods of lm-eval's requests; the group's acc is the mean over all its items."""
    from adept_ext.models import load_model

    workspace = write_run_workspace(tmp_path_factory.mktemp("suite"))
    monkeypatch.setenv("ADEPT_EXT_CACHE", str(workspace / "cache"))
    harness.task_manager.cache_clear()
    model, tokenizer = load_model(str(workspace / "tiny"))
    model.config.max_position_embeddings = 4096  # no truncation on either side (HFLM reads the context length here)
    model.eval()
    scores = harness.evaluate_benchmarks(model, tokenizer, ["adept_general", "adept_medical"], limit=LIMIT)
    for name in COUNTS:
        got = scores["items"][name]
        assert got["doc_ids"] == list(range(LIMIT)), name
        acc, acc_norm = [], []
        for doc in general_suite.olmo_docs(general_suite.TASKS[name])[:LIMIT]:
            contexts, continuations, gold = lm_eval_prompt(name, doc)
            lls = np.array([loglikelihood(model, tokenizer, c, t) for c, t in zip(contexts, continuations)])
            acc.append(float(np.argmax(lls) == gold))
            lengths = np.array([len(t) - 1 for t in continuations])  # lm-eval's: the choice's characters
            acc_norm.append(float(np.argmax(lls / lengths) == gold))
        assert got["metrics"]["acc"] == acc, name
        if "acc_norm" in general_suite.TASKS[name].metrics:
            assert got["metrics"]["acc_norm"] == acc_norm, name
    general = scores["tasks"]["adept_general"]["metrics"]["acc"]["value"]
    pooled = [v for name in general_suite.GROUPS["adept_general"] for v in scores["items"][name]["metrics"]["acc"]]
    assert general == pytest.approx(np.mean(pooled))
    assert scores["items"]["adept_general"]["metrics"]["acc"] == pooled  # the group's items, for the paired test
