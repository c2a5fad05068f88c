"""Experience replay (docs/methods.md §5), the simplest strong continual-learning baseline: while task t
trains, a buffer of the earlier tasks' training examples is mixed into its data — from each
earlier task max(1, round(f·n_i)) of its n_i training blocks, f = `replay_fraction` (default
0.02), drawn once per task with the run's seed — on top of `seq_full` (default) or `seq_lora`
(`replay_base`)."""
import random
from typing import List

from .. import data
from .base import Method, MethodError, create, register

BASES = ("full", "lora")


@register
class Replay(Method):
    name = "replay"
    description = "seq_full (or seq_lora) with a small buffer of earlier tasks' examples mixed in"
    single_domain = False
    sequence = True

    def __init__(self, cfg):
        super().__init__(cfg)
        if not 0 < cfg.replay_fraction <= 1:
            raise MethodError(f"replay_fraction must be in (0, 1], got {cfg.replay_fraction}")
        if cfg.replay_base not in BASES:
            raise MethodError(f"replay_base must be one of {', '.join(BASES)}, got {cfg.replay_base!r}")
        self.base = create(f"seq_{cfg.replay_base}", cfg, sequence=True)
        self.shardable = self.base.shardable

    def prepare(self, model, ctx, layers=None):
        setup = self.base.prepare(model, ctx, layers)
        setup.summary += f" on its data plus a {self.cfg.replay_fraction:.0%} replay buffer of earlier tasks"
        return setup

    def train_blocks(self, blocks: List[data.BlockSet], task_index: int) -> data.BlockSet:
        """Task `task_index`'s blocks with the buffer rows appended, in one seeded shuffle (read on
        access: the task's blocks are not copied)."""
        rng = random.Random(self.cfg.seed * 1000 + task_index)
        parts = [blocks[task_index]]
        for earlier in blocks[:task_index]:
            n = len(earlier)
            parts.append(data.BlockSet(earlier, sorted(rng.sample(range(n), max(1, round(self.cfg.replay_fraction * n))))))
        mixed = data.ConcatBlocks(parts)  # every task's blocks are block_len wide
        order = list(range(len(mixed)))
        rng.shuffle(order)
        return data.BlockSet(mixed, order)

    def attach(self, optimizer):
        self.base.attach(optimizer)

    def loss(self, model, batch):
        return self.base.loss(model, batch)

    def end_task(self, model, out, report):
        return self.base.end_task(model, out, report)

