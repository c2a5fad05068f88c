"""The protocol every adaptation method implements, and the registry the runners look methods up in.

A runner (`train.run` for one domain, `continual.run` for a task sequence) never branches on a
method's name; it calls these hooks, in this order, for every task:

    method = create(name, cfg)
    setup = method.prepare(model, ctx, layers)  # freeze / expand / wrap the model for the task
    method.write_artifacts(out)                 # what preparing computed (layer scores, diagnosis)
    optimizer = AdamW(setup.groups, ...)
    method.attach(optimizer)                    # optimizer-step hooks (e.g. ADEPT's per-unit rates)
    method.train_blocks(blocks, task)           # the task's training blocks (replay mixes in old tasks)
    ... loss = method.loss(model, batch) ...    # task loss (+ a method's penalty), backward, step
    model = method.end_task(model, out, report) # detach hooks, merge adapters, report extras

and to score task i (0-based) after any task, `continual.Evaluator` runs its evaluation on the
model that `with method.scoring(model, i) as scored:` yields: `model` itself for every method
but `per_task`, which yields `model` with task i's own adapter (and `model` before task i is
learned).

`state_dict()` / `load_state_dict()` carry what a method must keep across a kill (resume) and
across tasks. A kill inside a task resumes by loading the state the method had when the task
started, then `prepare`, then the state saved inside the task. A new method is one file in this
package: a `Method` subclass with the `@register` decorator; the runners and the CLI pick it up
by its name.
"""
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..data import BlockSet
from ..rundir import InputError

REGISTRY: Dict[str, type] = {}


class MethodError(InputError):
    """An input a method cannot work with (an unknown name, a sequence it does not learn, an option
    or a k that does not fit the model): one `adept-ext: error:` line in the CLI, and a ValueError
    for code that calls the methods directly. Any other exception inside a method is a bug and
    keeps its traceback."""


def register(cls):
    """Class decorator: make `cls` available to the runners under `cls.name`."""
    if cls.name in REGISTRY:
        raise ValueError(f"method {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls
    return cls


def method_names(single_domain: Optional[bool] = None, sequence: Optional[bool] = None) -> List[str]:
    """Registered names (in registration order), optionally only those for one domain or for sequences."""
    return [name for name, cls in REGISTRY.items()
            if (single_domain is None or cls.single_domain == single_domain)
            and (sequence is None or cls.sequence == sequence)]


def create(name: str, cfg, sequence: bool = False) -> "Method":
    """The method `name` configured by `cfg`; MethodError for an unknown name or for a method that
    cannot learn a task sequence when `sequence` is asked for (or cannot run alone when not)."""
    if name not in REGISTRY:
        raise MethodError(f"unknown method {name!r}; choose one of {', '.join(method_names(None, sequence or None))}")
    cls = REGISTRY[name]
    if sequence and not cls.sequence:
        raise MethodError(f"method {name!r} does not learn task sequences; choose one of "
                          f"{', '.join(method_names(sequence=True))}")
    if not sequence and not cls.single_domain:
        raise MethodError(f"method {name!r} is for task sequences (adept-ext continual); choose one of "
                          f"{', '.join(method_names(single_domain=True))}")
    return cls(cfg)


@dataclass
class Context:
    """What a method may use to prepare a task, besides the model."""

    general_probe: Sequence[Dict[str, torch.Tensor]]   # general-domain probe batches (ADEPT's Stage 1 and 2)
    domain_probe: Sequence[Dict[str, torch.Tensor]] = ()  # the domain's (task's) probe batches (placements)
    progress: bool = True
    autocast_dtype: Optional[torch.dtype] = None         # the training's autocast dtype (None: fp32)
    task_index: int = 0                                  # 0-based position in the sequence (0 for `run`)
    diagnosis_batches: Optional[Callable[[], List[Dict[str, torch.Tensor]]]] = None  # LayerTracer inputs
    log: Callable = print


@dataclass
class Setup:
    """What a method trains for the current task and how."""

    trainable: List[torch.nn.Parameter]
    groups: List[Dict]                        # optimizer param groups
    layers: List[int] = field(default_factory=list)  # layers expanded or trained (numbering of the model before the task)
    summary: str = ""                         # one line for the log: what is trained


def train_only(model, params) -> List[torch.nn.Parameter]:
    """Freeze every parameter of `model` except `params`; returns them as a list."""
    params = list(params)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


class Method:
    """Base class: full-parameter training with the task loss and no extras. Subclasses override
    the hooks they need (see the module docstring for the order the runners call them in)."""

    name = ""
    description = ""
    takes_layers = False   # accepts k / --layers
    single_domain = True   # usable by `adept-ext run`
    sequence = False       # usable by `adept-ext continual`
    shardable = True       # trains a model sharded by FSDP2 (--parallel fsdp2); the runners unshard it before end_task

    def __init__(self, cfg):
        self.cfg = cfg

    def check(self, model):
        """Options that depend on the model; raise MethodError before anything is changed."""

    def prepare(self, model, ctx: Context, layers: Optional[List[int]] = None) -> Setup:
        raise NotImplementedError

    def groups(self, trainable) -> List[Dict]:
        """One param group with the run's lr and weight decay."""
        return [{"params": trainable, "lr": self.cfg.lr, "weight_decay": self.cfg.weight_decay}]

    def write_artifacts(self, out):
        """Write what `prepare` computed (JSON/PNG) into the run directory."""

    def attach(self, optimizer):
        """Install optimizer-step hooks once the optimizer exists."""

    def step_note(self) -> str:
        """What the next optimizer step will do besides updating (for the progress bar), or ""."""
        return ""

    def train_blocks(self, blocks: List[BlockSet], task_index: int) -> BlockSet:
        """The training blocks of task `task_index`, given every task's training blocks (default: its own)."""
        return blocks[task_index]

    def loss(self, model, batch) -> torch.Tensor:
        """The training loss of one micro-batch (default: the model's next-token loss)."""
        return model(**batch, use_cache=False).loss

    def end_task(self, model, out, report: Dict):
        """After training a task: detach hooks, write plots into `out` (None: write nothing, e.g.
        on ranks other than 0), add report entries; returns the model to evaluate and save (a
        plain Hugging Face model)."""
        return model

    @contextmanager
    def scoring(self, model, task_index: int):
        """Yield the model that task `task_index` (0-based) is scored with (default: `model`)."""
        yield model

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state: Dict):
        pass
