"""The per-row computations replay selects, stores and distils with (docs/methods.md §5, "Replay"): the
final norm's outputs at the labelled positions, each row's loss (`select surprise`), the top-k
log-probabilities of the teacher (`replay_distill`), a task's label space and the answer losses over
it or without the earlier tasks' labels (`answer_loss`)."""
from typing import Dict

import numpy as np
import torch

from ...errors import InputError
from ...lm_loss import IGNORE_INDEX, final_hidden
from ...models import adapter, base_model
from ...models.packed_attention import packed_layout

MAX_LABEL_SPACE = 4096  # answer tokens of one task beyond which label_space is refused (not label strings)
SLOT = "replay_slot"  # the batch column naming a row's buffer slot (-1: the task's own row)
SCORE_ROWS = 16  # rows per forward when the end of a task scores or distils its rows


def labelled_hidden(model, rows):
    """Per chunk of `SCORE_ROWS` rows of `rows`: (row index within `rows`, position, the final
    norm's output at the position [P, H], the next token [P]) at every labelled position (a
    position p whose label p+1 is scored), the model in eval mode, without gradients."""
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), SCORE_ROWS):
                batch = rows.rows(np.arange(start, min(start + SCORE_ROWS, len(rows))))
                labels = batch["labels"].to(device)
                inputs = {k: v.to(device) for k, v in packed_layout(model, batch).items() if k not in (SLOT, "labels")}
                with final_hidden(model) as caught:
                    model(**inputs, use_cache=False, logits_to_keep=labels.new_empty(0))
                targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
                row, position = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
                hidden = caught[-1].reshape(*labels.shape, -1)
                yield start + row, position, hidden[row, position], targets[row, position]
    finally:
        model.train(training)


def row_losses(model, rows) -> torch.Tensor:
    """Each row's mean next-token loss over its labelled positions under `model` [len(rows)], float32 on the host."""
    ad = adapter(base_model(model))
    total, count = torch.zeros(len(rows)), torch.zeros(len(rows))
    for row, _, hidden, target in labelled_hidden(model, rows):
        total.index_add_(0, row.cpu(), ad.head_losses(hidden, target).float().cpu())
        count.index_add_(0, row.cpu(), torch.ones(len(row)))
    return total / count.clamp(min=1)


def top_k_log_probs(model, rows, k: int) -> Dict[str, torch.Tensor]:
    """The model's k largest next-token log-probabilities at every labelled position of `rows`, on
    the host: positions [P] (int64), ids [P, k] (int64), logprobs [P, k] (float32), offsets
    [len(rows) + 1] (row r's positions: offsets[r]:offsets[r+1])."""
    ad = adapter(base_model(model))
    positions, ids, logprobs, counts = [], [], [], torch.zeros(len(rows), dtype=torch.long)
    for row, position, hidden, _ in labelled_hidden(model, rows):
        top = ad.head_logits(hidden).float().log_softmax(-1).topk(min(k, ad.lm_head.weight.shape[0]), dim=-1)
        positions.append(position.cpu())
        ids.append(top.indices.cpu())
        logprobs.append(top.values.cpu())
        counts.index_add_(0, row.cpu(), torch.ones(len(row), dtype=torch.long))
    width = min(k, ad.lm_head.weight.shape[0])
    return {"positions": torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long),
            "ids": torch.cat(ids) if ids else torch.zeros(0, width, dtype=torch.long),
            "logprobs": torch.cat(logprobs) if logprobs else torch.zeros(0, width),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])}


def label_space(rows, task_index: int) -> torch.Tensor:
    """The sorted token ids labelled anywhere in a task's training `rows` (its answers and EOS):
    the softmax of answer_loss label_space. InputError for more than MAX_LABEL_SPACE (a text task)."""
    labels = torch.cat([rows.rows(np.arange(start, min(start + 1024, len(rows))))["labels"].flatten()
                        for start in range(0, len(rows), 1024)])
    space = torch.unique(labels[labels != IGNORE_INDEX])
    if len(space) > MAX_LABEL_SPACE:
        raise InputError(f"answer_loss label_space: task {task_index + 1}'s labels use {len(space)} distinct tokens "
                         f"(more than {MAX_LABEL_SPACE}): it is for instruction tasks whose answers are a few label "
                         "strings, not for text")
    return space


def label_space_sum(model, hidden: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                    space: torch.Tensor) -> torch.Tensor:
    """Σ over the labelled positions of rows `rows` ([B] bool) of −log softmax_space(logits)[target]:
    the logits of the tokens `space` only (sorted ids holding every target of those rows); `hidden`
    [B, T, H], `targets` [B, T] (the next token, IGNORE_INDEX where unscored). No host read."""
    logp = adapter(base_model(model)).head_logits_over(hidden, space).float().log_softmax(-1)
    index = torch.searchsorted(space, targets.clamp(min=0)).clamp(max=len(space) - 1)
    scored = rows[:, None] & (targets != IGNORE_INDEX)
    return -(logp.gather(-1, index.unsqueeze(-1)).squeeze(-1) * scored).sum()


def without_tokens_sum(model, hidden: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                       tokens: torch.Tensor) -> torch.Tensor:
    """Σ over `positions` ([B, T] bool; no target among `tokens`) of −log softmax(logits)[target], the
    softmax over the vocabulary less `tokens` (their logits −inf): a loss that does not push those tokens
    down. The full logits of those positions only (read on the host: which positions)."""
    row, position = positions.nonzero(as_tuple=True)
    logits = adapter(base_model(model)).head_logits(hidden[row, position]).float()
    logits[:, tokens] = -torch.inf
    return -logits.log_softmax(-1).gather(1, targets[row, position].unsqueeze(1)).sum()
