"""Experience replay (docs/methods.md §5), the simplest strong continual-learning baseline: while task t
trains, a buffer of the earlier tasks' training examples is mixed into its data — from each
earlier task max(1, round(f·n_i)) of its n_i training blocks, f = `fraction` (option
`replay_fraction`, default 0.02), drawn once per task with the run's seed (ctx.seed) — on top of
`seq_full` (default) or `seq_lora` (`base`, option `replay_base`; the LoRA's rank: `rank`)."""
import random
from dataclasses import dataclass
from typing import ClassVar, Dict, List

from .. import data
from .base import Method, MethodConfig, get_method, option, register
from .full import SeqFullConfig
from .lora import SeqLoraConfig

BASES = ("full", "lora")


@dataclass(kw_only=True)
class ReplayConfig(MethodConfig):
    """The buffer's share f of each earlier task, and the method it is mixed into."""

    method: ClassVar[str] = "replay"
    fraction: float = option(0.02, "replay_fraction", help=(
        "share of every earlier task's training blocks mixed into a later task"))
    base: str = option("full", "replay_base", help="on top of seq_full (full) or seq_lora (lora)")
    rank: int = option(8, "lora_rank", help="LoRA rank of the seq_lora base (replay_base lora)")

    def __post_init__(self):
        super().__post_init__()
        self.require("fraction", 0 < self.fraction <= 1, "must be in (0, 1]")
        self.require_one_of("base", BASES)
        self.base_config()  # checks the base's own options

    def base_config(self):
        """The config of the method the buffer is mixed into."""
        return SeqLoraConfig(rank=self.rank) if self.base == "lora" else SeqFullConfig()


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
        self.shardable = self.base.shardable
        self.trains_every_weight = self.base.trains_every_weight
        self.seed = None  # the run's seed (ctx.seed, from prepare): the buffer's draws

    def prepare(self, model, ctx, layers=None):
        self.seed = ctx.seed
        setup = self.base.prepare(model, ctx, layers)
        setup.summary += f" on its data plus a {self.config.fraction:.0%} replay buffer of earlier tasks"
        return setup

    def train_blocks(self, blocks: List[data.BlockSet], task_index: int) -> data.BlockSet:
        """Task `task_index`'s blocks with the buffer rows appended, in one seeded shuffle (read on
        access: the task's blocks are not copied). After `prepare` (its seed)."""
        rng = random.Random(self.seed * 1000 + task_index)
        parts = [blocks[task_index]]
        for earlier in blocks[:task_index]:
            n = len(earlier)
            parts.append(data.BlockSet(earlier, sorted(rng.sample(range(n), max(1, round(self.config.fraction * n))))))
        mixed = data.ConcatBlocks(parts)  # every task's blocks are block_len wide
        order = list(range(len(mixed)))
        rng.shuffle(order)
        return data.BlockSet(mixed, order)

    def attach(self, optimizer):
        self.base.attach(optimizer)

    def loss(self, model, batch, loss_implementation: str = "auto", num_items=None, micro_batches: int = 1):
        return self.base.loss(model, batch, loss_implementation, num_items, micro_batches)

    def end_task(self, model, out, report):
        return self.base.end_task(model, out, report)

    def state_dict(self) -> Dict:
        return self.base.state_dict()

    def load_state_dict(self, state: Dict):
        self.base.load_state_dict(state)

