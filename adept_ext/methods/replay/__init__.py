"""Experience replay (docs/methods.md §5), the simplest strong continual-learning baseline, on top of
`seq_full` (default) or `seq_lora` (`base`, option `replay_base`; the LoRA's rank: `rank`).

The buffer: when task i ends, m_i = max(1, round(f·n_i)) of its n_i training rows are kept,
f = `fraction` (`replay_fraction`), chosen by `select` (`replay_select`, seeded by the run's seed):
random (a draw), balanced (the same count per answer — a row's labelled tokens — round robin over
the answers) or surprise (the m_i rows of highest loss under the model at the task's end; SuRe).

A slow learner (`ema_decay` β > 0; I-LoRA, SuRe): after every optimizer step a slow copy of the
trained tensors moves toward them, θ_slow ← β_t·θ_slow + (1 − β_t)·θ, β_t = min(1 − 1/(t+1), β); the
task ends with the slow weights (the base method then merges them): scoring, the next task and the
export see them.

The answer loss on a task's own rows (`answer_loss`): token (the cross-entropy over the vocabulary);
label_space (VAG: −log softmax over S_t, the tokens the task's answers use, on rows whose every
target is in S_t); keep_old_labels (−log softmax over the vocabulary less E_t, the earlier tasks'
answer tokens not in S_t, on positions whose target is not in E_t): neither pushes the earlier
tasks' labels down. Other rows and positions keep the token loss.

Pseudo examples instead of stored rows (`source` generated; SSR): `pseudo_examples`.

The rate: with `ratio` R = 0 (`replay_ratio`) a later task trains on its own rows and the buffer,
each row once, in one seeded shuffle; with R > 0 a share R of every batch's rows comes from the
buffer, which is cycled (repeated as often as needed; `data.mix_blocks`), so a small buffer is seen
as often as R asks.

Distillation on the buffer (`distill` α > 0, `replay_distill`; DER++, SEEKR's top-k form): when task
i ends, the model's k largest log-probabilities (`distill_top_k`) at each labelled position of the
kept rows are stored; on a replayed row of a later task the loss adds

    α · Σ_positions KL(q ‖ p) / N,   q_j = exp(s_j) / Σ_k exp(s_k) over the stored top-k s,
                                     p = the current model's full next-token distribution,

N being what the task loss divides by (the step's labelled tokens): a replayed token's KL weighs α
times its cross-entropy. The rows a loss sees carry their buffer slot in the batch column
`replay_slot` (-1: the task's own row), read once per micro-batch on the host when α > 0.
"""
import random
from dataclasses import dataclass
from typing import ClassVar, Dict, List

import numpy as np
import torch

from ... import data
from ...errors import InputError
from ...lm_loss import IGNORE_INDEX, final_hidden
from ...models import adapter, base_model
from .scores import (SLOT, label_space, label_space_sum, row_losses, top_k_log_probs,
                     without_tokens_sum)
from ..base import Method, MethodConfig, get_method, option, register
from ..lora import sequential_config
from ..pseudo_examples import label_examples, pseudo_examples, task_format

BASES = ("full", "lora")
SELECTIONS = ("random", "balanced", "surprise")
SOURCES = ("examples", "generated", "none")
ANSWER_LOSSES = ("token", "label_space", "keep_old_labels")


@dataclass(kw_only=True)
class ReplayConfig(MethodConfig):
    """The buffer's share f of each earlier task, how it is chosen and replayed, and the method it is mixed into."""

    method: ClassVar[str] = "replay"
    fraction: float = option(0.02, "replay_fraction", help=(
        "share of every earlier task's training rows kept in the buffer"))
    ratio: float = option(0.0, "replay_ratio", help=(
        "share of every training batch drawn from the buffer, repeated as needed (0: each buffer row once, "
        "shuffled into the task's rows)"))
    select: str = option("random", "replay_select", help=(
        "which rows a task keeps: random, balanced (equal count per answer) or surprise (highest loss under the "
        "model at the task's end)"))
    distill: float = option(0.0, "replay_distill", help=(
        "weight α of KL(stored top-k ‖ model) on replayed rows (DER++-style distillation; 0: off)"))
    distill_top_k: int = option(20, "replay_distill_top_k", help=(
        "log-probabilities stored per labelled position of a buffer row (with --replay-distill)"))
    ema_decay: float = option(0.0, "ema_decay", help=(
        "β of a slow copy of the trainable weights, θ_slow ← β·θ_slow + (1 − β)·θ after every optimizer step; the "
        "task ends with the slow weights (I-LoRA, SuRe; 0: off)"))
    source: str = option("examples", "replay_source", help=(
        "what the buffer holds: examples (earlier training rows), generated (pseudo examples the model writes and "
        "answers at each task's end: nothing stored) or none (no buffer: the base method, with --answer-loss)"))
    temperature: float = option(1.0, "replay_temperature", help=(
        "sampling temperature of the pseudo examples' inputs (replay_source generated)"))
    label_replay: bool = option(False, "label_replay", help=(
        "add every earlier task's answer strings to its buffer as pseudo examples (the task's format around the "
        "answer's text, answered with it; VAG's label replay: label names, not examples)"))
    answer_loss: str = option("token", "answer_loss", help=(
        "token (cross-entropy over the vocabulary), label_space (a task's own rows: softmax over the tokens of "
        "its answers only) or keep_old_labels (a task's own rows: softmax over the vocabulary less the earlier tasks' "
        "answer tokens, so it does not push them down)"))
    base: str = option("full", "replay_base", help="on top of seq_full (full) or seq_lora (lora)")
    rank: int = option(8, "lora_rank", help="LoRA rank of the seq_lora base (replay_base lora)")
    freeze_bottom: int = option(0, "freeze_bottom", help=(
        "after the first task, the embeddings and the decoder layers below this one do not train (either base)"))

    def __post_init__(self):
        super().__post_init__()
        self.require("fraction", 0 < self.fraction <= 1, "must be in (0, 1]")
        self.require("ratio", 0 <= self.ratio < 1, "must be in [0, 1)")
        self.require_one_of("select", SELECTIONS)
        self.require("distill", np.isfinite(self.distill) and self.distill >= 0, "must be a finite number >= 0")
        self.require("distill_top_k", self.distill_top_k >= 1, "must be >= 1")
        self.require("ema_decay", 0 <= self.ema_decay < 1, "must be in [0, 1)")
        self.require("temperature", np.isfinite(self.temperature) and self.temperature > 0, "must be > 0")
        self.require_one_of("source", SOURCES)
        self.require_one_of("answer_loss", ANSWER_LOSSES)
        if self.source == "none":
            for name, value, default in (("select", self.select, "random"), ("distill", self.distill, 0)) + (
                    () if self.label_replay else (("ratio", self.ratio, 0),)):
                self.require(name, value == default, "is taken only with a buffer (replay_source examples or "
                             "generated; the ratio also with label_replay)")
        self.require_one_of("base", BASES)
        self.base_config()  # checks the base's own options

    def base_config(self):
        """The config of the method this one builds on (`lora.sequential_config`)."""
        return sequential_config(self.base, self.rank, self.freeze_bottom)


@register
class Replay(Method):
    name = "replay"
    config_class = ReplayConfig
    description = "seq_full (or seq_lora) with a small buffer of earlier tasks' examples mixed in"
    single_domain = False
    sequence = True

    def __init__(self, config):
        super().__init__(config)
        self.base = get_method(config.base_config())
        self.shardable = self.base.shardable and not config.ema_decay  # the slow copy follows unsharded weights
        self.trains_every_weight = self.base.trains_every_weight
        # its loss reads the batch's slots or scores answers its own way: hf.MethodCallback cannot, and refuses it
        self.own_loss_terms = config.distill > 0 or config.answer_loss != "token"
        self.seed, self.task_index, self.blocks, self.progress = None, 0, None, False  # prepare, train_blocks
        self.label_space = None  # the current task's answer tokens (answer_loss label_space), from train_blocks
        self.old_labels = None  # the earlier tasks' answer tokens not among this task's (keep_old_labels)
        self.kept: Dict[int, List[int]] = {}  # task index -> its buffer rows (indices into its training rows)
        self.stored: Dict[int, Dict[str, torch.Tensor]] = {}  # task index -> its rows' stored top-k (distill)
        self.generated: Dict[int, Dict[str, torch.Tensor]] = {}  # task index -> its pseudo examples (generated)
        self.labels: Dict[int, Dict[str, torch.Tensor]] = {}  # task index -> its answers as examples (label_replay)
        self.replayed = 0  # buffer rows the current task's losses saw (a device tensor once counted)
        self.fast, self.slow, self.handles = [], [], []  # ema_decay: the trained weights, their slow copy, hook
        self.ema_steps = 0  # the slow copy's updates in this task

    def check(self, model):
        self.base.check(model)

    def prepare(self, model, ctx, layers=None):
        self.seed, self.task_index, self.replayed, self.progress = ctx.seed, ctx.task_index, 0, ctx.progress
        setup = self.base.prepare(model, ctx, layers)
        c = self.config
        rate = f", {c.ratio:.0%} of each batch" if c.ratio else ""
        if c.source != "none":
            rows = "pseudo examples the model wrote" if c.source == "generated" else "rows"
            setup.summary += (f" on its data plus a {c.fraction:.0%} replay buffer of earlier tasks' {rows} "
                              f"({c.select}{rate})")
        if c.answer_loss != "token":
            setup.summary += f", answer loss {c.answer_loss}"
        return setup

    def train_blocks(self, blocks: List[data.BlockSet], task_index: int) -> data.BlockSet:
        """Task `task_index`'s rows with the earlier tasks' buffers (each kept when its task ended),
        mixed by `ratio`, every row tagged with its slot (`SLOT`). A view: nothing is copied."""
        if self.config.answer_loss == "label_space":
            self.label_space = label_space(blocks[task_index], task_index)
        if self.config.answer_loss == "keep_old_labels":  # the earlier tasks' answer tokens that are not this task's
            earlier = [label_space(blocks[i], i) for i in range(task_index)]
            self.old_labels = torch.from_numpy(np.setdiff1d(torch.cat(earlier).numpy(), label_space(
                blocks[task_index], task_index).numpy())) if earlier else torch.zeros(0, dtype=torch.long)
        missing = [i + 1 for i in range(task_index) if i not in self.kept]
        if missing:
            raise InputError(f"replay: no buffer of task(s) {missing}: finish() every earlier task of the sequence "
                             f"(its end keeps the buffer) before training task {task_index + 1}")
        if self.config.label_replay or self.config.source == "generated":  # refused now, not at the task's end
            task_format(blocks[task_index])
        self.blocks = blocks
        own = data.TaggedBlocks(blocks[task_index], SLOT, np.full(len(blocks[task_index]), -1))
        # slots: the kept rows task by task (the stored top-k's order, `slot_table`), then the answers' rows
        kept = [self.buffer(blocks, i) for i in range(task_index) if self.config.source != "none"]
        if self.config.label_replay:
            kept += [data.BlockSet(data.TensorBlocks(self.labels[i])) for i in range(task_index)]
        if not kept:
            return data.BlockSet(own)
        buffer = data.TaggedBlocks(data.ConcatBlocks(kept), SLOT, np.arange(sum(len(k) for k in kept)))
        seed = self.seed * 1000 + task_index
        if self.config.ratio:
            return data.mix_blocks(data.BlockSet(own), data.BlockSet(buffer), self.config.ratio, seed)
        order = list(range(len(own) + len(buffer)))
        random.Random(seed).shuffle(order)
        return data.BlockSet(data.ConcatBlocks([own, buffer]), order)

    def extra_bytes(self, trainable) -> int:
        """The slow copy of the trained tensors (ema_decay), in their dtype."""
        return sum(p.numel() * p.element_size() for p in trainable) if self.config.ema_decay else 0

    def buffer(self, blocks, i: int) -> data.BlockSet:
        """Task i's buffer rows: kept rows of its training data, or of its pseudo examples (generated)."""
        source = data.TensorBlocks(self.generated[i]) if self.config.source == "generated" else blocks[i]
        return data.BlockSet(source, self.kept[i])

    def attach(self, optimizer):
        """The base method's hooks; with ema_decay, the slow copy of the optimizer's parameters as
        they are now, moved toward them after every step."""
        self.base.attach(optimizer)
        if self.config.ema_decay:
            self.fast = [p for group in optimizer.param_groups for p in group["params"]]
            self.slow, self.ema_steps = [p.detach().clone() for p in self.fast], 0
            self.handles = [optimizer.register_step_post_hook(lambda *_: self.update_slow())]

    @torch.no_grad()
    def update_slow(self):
        """θ_slow ← β_t·θ_slow + (1 − β_t)·θ for every trained tensor (one multi-tensor lerp), β_t =
        min(1 − 1/(t+1), β) at the task's t-th step from 0 (I-LoRA's warm-up: the first steps follow θ)."""
        beta = min(1 - 1 / (self.ema_steps + 1), self.config.ema_decay)
        torch._foreach_lerp_(self.slow, [p.detach() for p in self.fast], 1 - beta)
        self.ema_steps += 1

    def loss(self, model, batch, loss_implementation: str = "auto", num_items=None, micro_batches: int = 1):
        """The base method's loss of the batch (its `SLOT` column dropped), with the task's own rows
        scored over its label space (answer_loss label_space) and the distillation term on its
        replayed rows (module docstring); every term divided by the step's labelled tokens."""
        batch = dict(batch)
        slots = batch.pop(SLOT, None)
        if slots is not None:
            self.replayed = self.replayed + (slots >= 0).sum()  # on the device: read when the task ends
        distill = bool(self.config.distill and self.stored and slots is not None)
        space = self.label_space if self.config.answer_loss == "label_space" else None
        old = self.old_labels if self.config.answer_loss == "keep_old_labels" and len(self.old_labels) else None
        if not distill and space is None and old is None:  # a caller's own batches (no slots): none is replayed
            return self.base.loss(model, batch, loss_implementation, num_items, micro_batches)
        labels = batch["labels"]
        targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        total = (targets != IGNORE_INDEX).sum() if num_items is None else num_items
        own = torch.ones_like(labels[:, 0], dtype=torch.bool) if slots is None else slots < 0
        if space is not None:  # those rows leave the token loss: their labels are scored over the space below
            in_space = (torch.isin(targets, space.to(labels.device)) | (targets == IGNORE_INDEX)).all(1) & own
            batch["labels"] = labels.masked_fill(in_space[:, None], IGNORE_INDEX)
        if old is not None:  # those positions leave the token loss: scored without the old labels below
            old = old.to(labels.device)
            kept_out = own[:, None] & (targets != IGNORE_INDEX) & ~torch.isin(targets, old)
            batch["labels"] = torch.cat([labels[:, :1], labels[:, 1:].masked_fill(kept_out[:, :-1], IGNORE_INDEX)], 1)
        with final_hidden(model) as caught:
            loss = self.base.loss(model, batch, loss_implementation, total, micro_batches)
        hidden = caught[-1].reshape(*labels.shape, -1)
        if space is not None:
            loss = loss + label_space_sum(model, hidden, targets, in_space, space.to(labels.device)) / total
        if old is not None:
            loss = loss + without_tokens_sum(model, hidden, targets, kept_out, old) / total
        if distill:
            loss = loss + self.config.distill * self.distill_sum(model, hidden, slots) / total
        return loss

    def distill_sum(self, model, hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Σ over the replayed rows' stored positions of KL(q ‖ p) (module docstring); `hidden`
        [B, T, H] the final norm's output, `slots` [B] (read on the host)."""
        table = self.slot_table()
        rows, positions, ids, logprobs = [], [], [], []
        for row, slot in enumerate(slots.tolist()):
            if 0 <= slot < len(table):  # a kept row (the answers' rows of label_replay come after them)
                stored, start, end = table[slot]
                rows.append(torch.full((end - start,), row, dtype=torch.long))
                positions.append(stored["positions"][start:end])
                ids.append(stored["ids"][start:end])
                logprobs.append(stored["logprobs"][start:end])
        if not rows:
            return hidden.new_zeros((), dtype=torch.float32)
        device = hidden.device
        picked = hidden[torch.cat(rows).to(device), torch.cat(positions).to(device)]
        current = adapter(base_model(model)).head_logits(picked).float().log_softmax(-1)
        target = torch.cat(logprobs).to(device).log_softmax(-1)  # q: the stored top-k renormalised
        return (target.exp() * (target - current.gather(1, torch.cat(ids).to(device)))).sum()

    def slot_table(self):
        """Slot s -> (its task's stored tensors, start, end of its positions), slots numbered as
        `train_blocks` numbers the buffer (task by task, in kept order)."""
        table = []
        for i in sorted(self.kept):
            stored = self.stored[i]
            offsets = stored["offsets"].tolist()
            table += [(stored, offsets[r], offsets[r + 1]) for r in range(len(offsets) - 1)]
        return table

    def end_task(self, model, out, report):
        """The base method's end, then the task's buffer (and its stored top-k) from its training rows:
        those `train_blocks` was given; none when it was not called (a later `train_blocks` refuses)."""
        if self.config.ema_decay and self.slow:  # the task ends with the slow weights: merged, scored, saved
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.fast], self.slow)
            for handle in self.handles:
                handle.remove()
            report["ema"] = {"decay": self.config.ema_decay,
                             "bytes": sum(t.numel() * t.element_size() for t in self.slow)}
            self.fast, self.slow, self.handles = [], [], []
        model = self.base.end_task(model, out, report)
        if self.blocks is None:
            return model
        rows = self.blocks[self.task_index]
        replayed = self.replayed
        if torch.distributed.is_initialized():  # every rank's count (each calls end_task), on the backend's device
            replayed = torch.as_tensor(replayed, dtype=torch.long, device=next(model.parameters()).device)
            torch.distributed.all_reduce(replayed)
        replayed = int(replayed)
        entry = {}
        if self.config.label_replay:
            self.labels[self.task_index] = label_examples(rows)
            entry["label_rows"] = len(self.labels[self.task_index]["input_ids"])
        if self.config.source == "none":
            self.kept[self.task_index] = []
            report["replay"] = {"kept_rows": 0, "replayed_rows": replayed, **entry}
            return model
        m = max(1, round(self.config.fraction * len(rows)))
        if self.config.source == "generated":  # the candidates the selection chooses from: the model's own
            candidates = 1 if self.config.select == "random" else 2
            self.generated[self.task_index] = pseudo_examples(model, rows, candidates * m, self.config.temperature,
                                                              self.seed * 1000 + 700 + self.task_index, self.progress)
            rows = data.BlockSet(data.TensorBlocks(self.generated[self.task_index]))
            entry["generated_rows"] = len(rows)
            if not len(rows):
                raise InputError(f"replay_source generated: the model wrote no usable pseudo example of task "
                                 f"{self.task_index + 1} (every sample was empty, a duplicate or unanswered)")
        losses = row_losses(model, rows) if self.config.select == "surprise" else None
        self.kept[self.task_index] = self.choose(rows, losses, min(m, len(rows)))
        entry.update(kept_rows=len(self.kept[self.task_index]), replayed_rows=replayed)
        if self.config.distill:
            self.stored[self.task_index] = top_k_log_probs(model, data.BlockSet(rows, self.kept[self.task_index]),
                                                           self.config.distill_top_k)
            entry["stored_bytes"] = sum(t.numel() * t.element_size() for s in self.stored.values() for t in s.values())
        report["replay"] = entry
        return model

    def choose(self, rows, losses=None, m: int = None) -> List[int]:
        """The m rows (default max(1, round(f·n))) of a finished task its buffer keeps (module docstring), sorted."""
        n = len(rows)
        m = max(1, round(self.config.fraction * n)) if m is None else m
        rng = random.Random(self.seed * 1000 + 500 + self.task_index)
        if self.config.select == "random":
            return sorted(rng.sample(range(n), m))
        if self.config.select == "surprise":
            return sorted(np.argsort(-losses.numpy(), kind="stable")[:m].tolist())
        labels = rows.rows(np.arange(n))["labels"]
        groups: Dict[tuple, List[int]] = {}
        for i, row in enumerate(labels.tolist()):
            groups.setdefault(tuple(t for t in row if t != IGNORE_INDEX), []).append(i)
        queues = [groups[key] for key in sorted(groups)]
        rng.shuffle(queues)
        for queue in queues:
            rng.shuffle(queue)
        chosen = []
        while len(chosen) < m:  # round robin over the answers: equal counts, ±1
            for queue in queues:
                if queue and len(chosen) < m:
                    chosen.append(queue.pop())
        return sorted(chosen)

    def state_dict(self) -> Dict:
        replayed = int(self.replayed) if torch.is_tensor(self.replayed) else self.replayed
        return {"base": self.base.state_dict(), "kept": {i: list(k) for i, k in self.kept.items()},
                "stored": self.stored, "generated": self.generated, "labels": self.labels, "replayed": replayed,
                "slow": [t.detach().cpu() for t in self.slow], "ema_steps": self.ema_steps}

    def load_state_dict(self, state: Dict):
        self.base.load_state_dict(state["base"])
        self.kept = {int(i): list(k) for i, k in state["kept"].items()}
        self.stored = {int(i): dict(s) for i, s in state["stored"].items()}
        self.generated = {int(i): dict(g) for i, g in state["generated"].items()}
        self.labels = {int(i): dict(g) for i, g in state["labels"].items()}
        self.replayed = state["replayed"]
        self.ema_steps = state["ema_steps"]
        if state["slow"]:  # inside a task (after attach): its slow copy as the checkpoint held it
            if len(state["slow"]) != len(self.slow):
                raise InputError(f"the checkpoint's slow copy (ema_decay) holds {len(state['slow'])} tensors; this "
                                 f"task trains {len(self.slow)}: it was written by another configuration")
            with torch.no_grad():
                torch._foreach_copy_(self.slow, [t.to(s.device) for t, s in zip(state["slow"], self.slow)])
