"""A-GEM (Averaged Gradient Episodic Memory, Chaudhry et al., ICLR 2019) on seq_lora (docs/methods.md
§5, "A-GEM"): each task keeps a small random buffer of its training rows; at every optimizer step of a
later task, the gradient g_ref of the loss on `agem_batch` rows drawn from the buffer is computed, and
where the task's gradient g conflicts with it,

    g ← g − (⟨g, g_ref⟩ / ‖g_ref‖²) · g_ref      if ⟨g, g_ref⟩ < 0,

so the step does not raise the buffer's loss to first order. The dot products and the update are one
multi-tensor pass of the project's fused kernel (`ops.conflict_correct_` with no added term), on the
trainable tensors' gradients after the step's backward (and clipping), before the optimizer reads them.
"""
import random
from dataclasses import dataclass
from typing import ClassVar, Dict, List

import torch

from .. import data, parallel
from ..errors import MethodError
from ..lm_loss import next_token_loss
from ..ops import conflict_correct_
from .base import option, register
from .lora import SeqLora, SeqLoraConfig


@dataclass(kw_only=True)
class AgemConfig(SeqLoraConfig):
    """The buffer's share of each task and the reference batch, on seq_lora of rank `lora_rank`."""

    method: ClassVar[str] = "agem"
    fraction: float = option(0.02, "replay_fraction", help=(
        "share of every earlier task's training rows kept in the buffer"))
    batch: int = option(8, "agem_batch", help="buffer rows of the reference gradient at each step")

    def __post_init__(self):
        super().__post_init__()
        self.require("fraction", 0 < self.fraction <= 1, "must be in (0, 1]")
        self.require("batch", self.batch >= 1, "must be >= 1")


@register
class Agem(SeqLora):
    name = "agem"
    config_class = AgemConfig
    description = "seq_lora whose gradient is projected off the conflict with a small buffer's (A-GEM)"
    records_subspaces = False
    shardable = False  # the reference gradient is the whole tensors' on one process

    def __init__(self, config):
        super().__init__(config)
        self.kept: Dict[int, List[int]] = {}  # task index -> its buffer rows
        self.blocks, self.task_index, self.seed, self.autocast = None, 0, 0, None
        self.steps, self.projected, self.handle, self.trainable = 0, 0, None, []

    def prepare(self, model, ctx, layers=None):
        if parallel.world_size() > 1:
            raise MethodError("agem computes its reference gradient on one process: run it without torchrun")
        self.task_index, self.seed, self.autocast = ctx.task_index, ctx.seed, ctx.autocast_dtype
        setup = super().prepare(model, ctx, layers)
        self.trainable = setup.trainable
        if self.kept:
            setup.summary += (f", its gradient projected off conflicts with a buffer of "
                              f"{sum(map(len, self.kept.values()))} earlier rows (A-GEM, {self.config.batch} a step)")
        return setup

    def train_blocks(self, blocks, task_index: int):
        self.blocks = blocks
        return super().train_blocks(blocks, task_index)

    def buffer(self) -> data.BlockSet:
        """The earlier tasks' kept rows, task after task."""
        return data.BlockSet(data.ConcatBlocks([data.BlockSet(self.blocks[i], rows) for i, rows in
                                                sorted(self.kept.items())]))

    def attach(self, optimizer):
        super().attach(optimizer)
        if self.kept:
            self.handle = optimizer.register_step_pre_hook(self.before_step)

    def before_step(self, optimizer, args, kwargs):
        """The optimizer's step pre-hook: `project`, the step's arguments unchanged."""
        self.project()

    def reference_batch(self) -> Dict[str, torch.Tensor]:
        """`agem_batch` buffer rows drawn for this step (seeded by the run's seed, the task and the step)."""
        buffer = self.buffer()
        draw = random.Random((self.seed * 1000 + self.task_index) * 1_000_003 + self.steps)
        return buffer.rows(sorted(draw.sample(range(len(buffer)), min(self.config.batch, len(buffer)))))

    def project(self) -> torch.Tensor:
        """The step's A-GEM projection of the trainable tensors' gradients (module docstring); returns the
        kernel's [⟨g, g_ref⟩, ‖g_ref‖², ‖g‖², removed coefficient]."""
        params = [p for p in self.trainable if p.grad is not None]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        device = params[0].device
        batch = {k: v.to(device) for k, v in self.reference_batch().items()}
        with torch.autocast(device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            loss = next_token_loss(self.peft_model, batch)
        reference = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip(params, grads):
            p.grad = g
        stats = conflict_correct_(grads, [torch.zeros_like(g) if r is None else r.to(g.dtype)
                                          for g, r in zip(grads, reference)], lam=0.0, eps=0.0)
        self.projected = self.projected + (stats[0] < 0).long()  # on the device: read when the task ends
        self.steps += 1
        return stats

    def end_task(self, model, out, report):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
            report["agem"] = {"steps": self.steps, "projected_steps": int(self.projected),
                              "buffer_rows": sum(map(len, self.kept.values()))}
        if self.blocks is not None:
            rows = len(self.blocks[self.task_index])
            draw = random.Random(self.seed * 1000 + self.task_index)
            self.kept[self.task_index] = sorted(draw.sample(range(rows), max(1, round(self.config.fraction * rows))))
        self.steps, self.projected = 0, 0
        return super().end_task(model, out, report)

    def state_dict(self) -> Dict:
        return {"kept": {i: list(k) for i, k in self.kept.items()}, "steps": self.steps,
                "projected": int(self.projected)}

    def load_state_dict(self, state: Dict):
        self.kept = {int(i): list(k) for i, k in state["kept"].items()}
        self.steps, self.projected = state["steps"], state["projected"]
