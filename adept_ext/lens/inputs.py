"""LayerTracer's inputs (docs/methods.md §3): composite sequences s_1 ⊕ s_2 whose query part the
logit lens and the context sensitivity of `lens.diagnosis` score — few-shot BBC News topic classification,
or corpus blocks split into a context half and a query half."""
import random
from typing import Dict, List, Sequence

import torch

from ..data.blocks import pad_id, pad_rows
from ..data.sources import bbc_news_labelled
from ..errors import InputError


def fewshot_topic_task(tokenizer, n_queries: int = 16, shots: int = 5, words: int = 40, batch_size: int = 8,
                       seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """Composite inputs s_1 ⊕ s_2 for LayerTracer's diagnostics (docs/methods.md §3): few-shot topic
    classification over BBC News. s_1 (context) is `shots` labelled examples, each
    "Article: <first `words` words>\nTopic: <category>\n\n" with the categories in turn; s_2
    (query) is "Article: <first `words` words of another article>\nTopic:", whose next token is
    the answer. Returns right-padded batches with input_ids, attention_mask, context_mask (bool,
    marks s_1), score_mask (bool, the query's last token) and answer_ids (first token of
    " <category>"), drawn deterministically from `seed`."""
    if n_queries < 1 or shots < 1 or words < 1 or batch_size < 1:
        raise InputError("n_queries, shots, words and batch_size must be >= 1")
    articles = bbc_news_labelled()
    rng = random.Random(seed)
    by_topic: Dict[str, List[int]] = {}
    for i, (_, topic) in enumerate(articles):
        by_topic.setdefault(topic, []).append(i)
    topics = sorted(by_topic)

    def excerpt(i):
        return " ".join(articles[i][0].split()[:words])

    def tokens(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    pad = pad_id(tokenizer)
    rows, context_lens, answers = [], [], []
    for query in rng.sample(range(len(articles)), n_queries):
        order = rng.sample(topics, len(topics))
        examples = [rng.choice([i for i in by_topic[order[j % len(order)]] if i != query]) for j in range(shots)]
        context = tokens("".join(f"Article: {excerpt(i)}\nTopic: {articles[i][1]}\n\n" for i in examples))
        rows.append(context + tokens(f"Article: {excerpt(query)}\nTopic:"))
        context_lens.append(len(context))
        answers.append(tokens(" " + articles[query][1])[0])
    out = []
    for b0 in range(0, n_queries, batch_size):
        ids, mask = pad_rows(rows[b0:b0 + batch_size], pad)
        positions = torch.arange(ids.shape[1])
        lens = mask.sum(1, keepdim=True)
        out.append({"input_ids": ids, "attention_mask": mask,
                    "context_mask": positions < torch.tensor(context_lens[b0:b0 + batch_size])[:, None],
                    "score_mask": positions == lens - 1, "answer_ids": torch.tensor(answers[b0:b0 + batch_size])})
    return out


def context_query_task(batches_: Sequence[Dict[str, torch.Tensor]], context_len: int) -> List[Dict[str, torch.Tensor]]:
    """Composite inputs for LayerTracer's diagnostics from any corpus (docs/methods.md §3): in every block of
    `batches_` the first `context_len` tokens are the context s_1, the rest the query s_2, and
    every query position with a next token is scored. Raises ValueError when no block is longer
    than the context."""
    out = []
    for batch in batches_:
        positions = torch.arange(batch["input_ids"].shape[1])
        context = (positions < context_len).expand_as(batch["input_ids"]) & (batch["attention_mask"] == 1)
        has_next = torch.cat([batch["labels"][:, 1:] != -100, torch.zeros_like(context[:, :1])], dim=1)
        out.append({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                    "context_mask": context, "score_mask": has_next & ~context})
    if not any(b["score_mask"].any() for b in out):
        raise InputError(f"no block is longer than the context ({context_len} tokens): nothing to score")
    return out
