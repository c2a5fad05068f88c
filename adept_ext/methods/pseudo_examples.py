"""Pseudo examples of a finished instruction task, written by the model itself: replay with nothing
stored (docs/methods.md §5, "Replay"; SSR, Huang et al., ACL 2024; LAMOL, Sun et al., ICLR 2020).

The task's format is read from its training rows: the prompt of a row is its tokens before the first
labelled one, and every prompt shares a prefix (BOS, the input's field name: "Question:") and a
suffix (the instruction: "\\nAnswer type:"). The model samples a body after the prefix (temperature
sampling, stopped at the suffix's first token or EOS, at most the longest body of the task), the
suffix is appended, and the model as it is then answers greedily (stopped at the tokens the task's
answers end with). Empty bodies or answers and duplicate bodies are dropped. The rows have the
task's width, right-padded, labelled on the answer only, as the task's own rows are. Where the prompts
share no prefix (the input comes first, the instruction after it), sampling starts from the model's
document start (its BOS token, else its EOS token, which separates documents in pretraining), which is
not kept in the row.
"""
from typing import Dict, List, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import InputError
from ..lm_loss import IGNORE_INDEX


def common_prefix(rows: Sequence[Sequence[int]]) -> List[int]:
    first = rows[0]
    n = len(first)
    for row in rows[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], row)) if a != b), min(n, len(row)))
    return list(first[:n])


def task_format(rows) -> Dict:
    """The prompts' shared prefix and suffix, the longest body, the answers' end tokens and the
    longest answer of a task's training rows (`rows.rows`: input_ids, attention_mask, labels)."""
    batch = rows.rows(np.arange(len(rows)))
    prompts, answers = [], []
    for ids, labels, mask in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                 batch["attention_mask"].tolist()):
        first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
        if first is None:
            continue
        prompts.append(ids[:first])
        answers.append([label for label in labels[first:sum(mask)] if label != IGNORE_INDEX])
    if not prompts:
        raise InputError("replay_source generated: the task has no labelled row to read its format from")
    if max(len(p) for p in prompts) <= 1:
        raise InputError("replay_source generated: the task's rows are labelled from their start (a text task): "
                         "pseudo examples are written for instruction tasks")
    prefix = common_prefix(prompts)
    suffix = common_prefix([p[len(prefix):][::-1] for p in prompts])[::-1]
    if len(prefix) + len(suffix) == 0:
        raise InputError("replay_source generated: the task's prompts share no prefix or suffix (no instruction "
                         "or field name to prompt the model with): it is for instruction tasks of one format")
    padding = batch["input_ids"][batch["attention_mask"] == 0]
    return {"prefix": prefix, "suffix": suffix, "width": int(batch["input_ids"].shape[1]),
            "body": max(len(p) - len(prefix) - len(suffix) for p in prompts),
            "answer": max(len(a) for a in answers), "ends": sorted({a[-1] for a in answers if a}),
            "answers": sorted({tuple(a) for a in answers if a}), "pad": int(padding[0]) if len(padding) else 0}


def as_rows(pairs: Sequence, width: int, pad: int) -> Dict[str, torch.Tensor]:
    """(prompt, answer) token lists as the task's rows: [len(pairs), width], right-padded with `pad`,
    labelled on the answer only."""
    ids = torch.full((len(pairs), width), pad, dtype=torch.long)
    labels = torch.full((len(pairs), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for r, (prompt, answer) in enumerate(pairs):
        ids[r, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[r, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
        mask[r, :len(prompt) + len(answer)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def label_examples(rows) -> Dict[str, torch.Tensor]:
    """One pseudo example per distinct answer of a task's training `rows` (VAG's label replay): the
    task's prefix, the answer's text (less its end token) as the input, the suffix, answered with the
    answer. Label names, not examples: no input of the task is in them. Answers too wide are left out."""
    fmt = task_format(rows)
    pairs = [(fmt["prefix"] + list(a[:-1]) + fmt["suffix"], list(a)) for a in fmt["answers"]]
    return as_rows([(p, a) for p, a in pairs if len(p) + len(a) <= fmt["width"]], fmt["width"], fmt["pad"])


@torch.no_grad()
def pseudo_examples(model, rows, n: int, temperature: float, seed: int,
                    progress: bool = True) -> Dict[str, torch.Tensor]:
    """Up to `n` distinct pseudo examples of the task whose training rows are `rows` (module
    docstring), sampled with `temperature` from a generator seeded with `seed` (the global RNGs are
    left as they were): input_ids, attention_mask, labels [≤ n, width] on the host. At most 4·n bodies
    are sampled."""
    fmt = task_format(rows)
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    pad = fmt["pad"]
    start = fmt["prefix"] or document_start(model, eos)
    stops = sorted(set(eos + fmt["suffix"][:1]))  # a body ends where the instruction (or the text) would
    training = model.training
    model.eval()
    seen, made = set(), []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            bar = tqdm(total=n, desc="pseudo examples", disable=not progress)
            for _ in range(4):
                prompt = torch.tensor([start] * n, device=device)
                out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                     temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=fmt["body"],
                                     eos_token_id=stops, pad_token_id=pad)[:, prompt.shape[1]:].tolist()
                for sampled in out:
                    body = sampled[:next((i for i, t in enumerate(sampled) if t in stops), len(sampled))]
                    if not body or tuple(body) in seen or len(made) == n:
                        continue
                    seen.add(tuple(body))
                    row = answered(model, fmt["prefix"] + body + fmt["suffix"], fmt, pad, device)
                    if row is not None:
                        made.append(row)
                        bar.update(1)
                if len(made) == n:
                    break
            bar.close()
    finally:
        model.train(training)
    return as_rows(made, fmt["width"], pad)


def document_start(model, eos: List[int]) -> List[int]:
    """The token a document starts after: the model's BOS, else its first EOS; InputError without either."""
    bos = model.generation_config.bos_token_id
    if bos is not None:
        return [int(bos)]
    if eos:
        return [int(eos[0])]
    raise InputError("replay_source generated: the task's prompts share no prefix and the model has neither a BOS "
                     "nor an EOS token to start a pseudo example from")


def answered(model, prompt: List[int], fmt: Dict, pad: int, device):
    """(prompt, the model's greedy answer through its end token) or None: an empty answer, one that
    does not end within the task's longest answer, or a row wider than the task's."""
    ids = torch.tensor([prompt], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=fmt["answer"], eos_token_id=fmt["ends"], pad_token_id=pad)
    answer = out[0, len(prompt):].tolist()
    end = next((i for i, t in enumerate(answer) if t in fmt["ends"]), None)
    if end is None or end == 0 or len(prompt) + end + 1 > fmt["width"]:
        return None
    return prompt, answer[:end + 1]
