"""The protocol every adaptation method implements, and the registry the runners look methods up in.

A runner (`train.run` for one domain, `continual.run` for a task sequence) never branches on a
method's name; it calls these hooks, in this order, for every task:

    method = create(name, options)              # or get_method(AdeptConfig(k=4, ...))
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
started, then `prepare`, then the state saved inside the task.

A method reads no runner's options: its own options are a `MethodConfig` dataclass that checks
itself when it is built (MethodError), and the training it prepares for (learning rate, weight
decay, steps, seed) comes with the `Context` of `prepare`. A new method is one file in this
package: a `MethodConfig` subclass naming the method, each field an `option(default, flat_name,
help=...)`, and a `Method` subclass with the `@register` decorator whose `config_class` is that
config; the runners and the CLI pick it up by its name, and its options become flags, TOML keys
and `run.json` entries of the runners that run it (`training.with_method_options`).
"""
import logging
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Collection, Dict, List, Optional, Sequence

import torch

from ..data import BlockSet
from ..errors import MethodError
from ..lm_loss import next_token_loss

REGISTRY: Dict[str, type] = {}
PROPERTIES = ("resumable", "one_way", "affects_results", "former_names", "known_as", "commands")  # see `option`
logger = logging.getLogger(__name__)


def option(default, name: Optional[str] = None, parse: Optional[Callable] = None, help: str = "",
           flat: Any = MISSING, *, resumable: bool = False, one_way: bool = False, affects_results: bool = True,
           former_names: Sequence[str] = (), known_as: Sequence[str] = (), commands: Sequence[str] = ()):
    """A config field: its default, its help text, and the runner's flat option it comes from
    (`name`; default: the field's own name), read through `parse` where the option's form differs
    from the field's (then `flat` is the option's own default, e.g. "" for `layers`). The runners'
    flags, TOML keys, run.json and the `docs/cli.md` tables are derived from these fields
    (`method_options`); a field whose option is a runner's own (e.g. `diagnosis_task`) reads it.

    A runner's option also declares its properties here, each read from the declaration alone
    (`training.config.marked`): `resumable` (may change on --resume), `one_way` (a switch without a
    --no- form), `affects_results` (False: never changes what a run computes, e.g. where it writes),
    `former_names` (flags, TOML keys and older run.json keys that still name it), `known_as` (other
    tools' names for it, suggested for an unknown option) and `commands` (the one-off commands —
    probe, expand, eval, diagnose — that take it; run, train and continual take every option)."""
    metadata = {k: v for k, v in (("option", name), ("parse", parse), ("help", help or None), ("flat", flat),
                                  ("resumable", resumable or None), ("one_way", one_way or None),
                                  ("affects_results", None if affects_results else False),
                                  ("former_names", tuple(former_names) or None), ("known_as", tuple(known_as) or None),
                                  ("commands", tuple(commands) or None))
                if v is not None and v is not MISSING}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class OptionSpec:
    """A flat option of one or several methods: its name and type, and per method that takes it
    (in registration order) its default and help text there, and the properties its declarations
    give it (`option(..., commands=...)`, merged over the methods)."""

    name: str
    type: type
    defaults: Dict[str, Any]
    helps: Dict[str, str]
    properties: Dict[str, Any] = field(default_factory=dict)

    @property
    def default(self):
        """The default when every method that takes the option agrees on it, else None."""
        values = list(self.defaults.values())
        return values[0] if len({repr(v) for v in values}) == 1 else None

    def help(self, show_default=repr) -> str:
        """"methods: help" for each group of methods that share the help text and default; each
        group's default (shown by `show_default`) is named only where the methods differ on it."""
        groups: Dict[tuple, List[str]] = {}
        for method, text in self.helps.items():
            groups.setdefault((text, self.defaults[method]), []).append(method)
        agree = len({repr(d) for d in self.defaults.values()}) == 1
        return "; ".join(f"{', '.join(methods)}: {text}" + ("" if agree else f" (default {show_default(default)})")
                         for (text, default), methods in groups.items())


def method_options(names: Sequence[str], runner_fields: Collection[str] = ()) -> Dict[str, OptionSpec]:
    """The flat options of the registered methods `names` (in registration and field order),
    leaving out those that are a runner's own (`runner_fields`). ValueError for an option without
    help text, or one that two methods declare with different types."""
    specs: Dict[str, OptionSpec] = {}
    for method in names:
        cls = REGISTRY[method].config_class
        for f in fields(cls):
            flat = f.metadata.get("option", f.name)
            if flat in runner_fields:
                continue
            default = f.metadata.get("flat", f.default)
            kind = type(default) if "parse" in f.metadata else f.type
            text = f.metadata.get("help")
            if not text:
                raise ValueError(f"{cls.__name__}.{f.name}: a method option needs its help text "
                                 f"(option(..., help=...))")
            spec = specs.get(flat)
            if spec is not None and spec.type is not kind:
                raise ValueError(f"option {flat!r}: {cls.__name__}.{f.name} is a {kind}, another method's "
                                 f"is a {spec.type}")
            properties = {k: v for k, v in f.metadata.items() if k in PROPERTIES}
            specs[flat] = OptionSpec(flat, kind, {**(spec.defaults if spec else {}), method: default},
                                     {**(spec.helps if spec else {}), method: text},
                                     {**(spec.properties if spec else {}), **properties})
    return specs


@dataclass(kw_only=True)
class MethodConfig:
    """The options of one method (PEFT-style): a dataclass per registered method, named by its
    `method` class attribute, that checks its values when built (MethodError, before anything is
    created). Subclasses share fields by inheritance and extend `__post_init__`."""

    method: ClassVar[str] = ""  # the registered method this config configures ("": a shared base)

    def __post_init__(self):
        """Check the values (MethodError); subclasses call super() first, then check their own."""

    @classmethod
    def from_options(cls, options: Any) -> "MethodConfig":
        """The config from a runner's flat options (`RunConfig`, `ContinualConfig`): each field
        from the option its metadata names; the field's default where the runner has no such option."""
        values = {}
        for f in fields(cls):
            value = getattr(options, f.metadata.get("option", f.name), MISSING)
            if value is not MISSING:
                values[f.name] = f.metadata["parse"](value) if "parse" in f.metadata else value
        return cls(**values)

    def option_name(self, name: str) -> str:
        """The runner's flat option that field `name` comes from (the name error messages use)."""
        return next(f.metadata.get("option", f.name) for f in fields(self) if f.name == name)

    def require(self, name: str, ok: bool, rule: str):
        """MethodError "<option> <rule>, got <value>" unless `ok`."""
        if not ok:
            raise MethodError(f"{self.option_name(name)} {rule}, got {getattr(self, name)!r}")

    def require_one_of(self, name: str, allowed: Collection[str]):
        self.require(name, getattr(self, name) in allowed, f"must be one of {', '.join(allowed)}")


def register(cls):
    """Class decorator: make `cls` available to the runners under `cls.name`, configured by
    `cls.config_class` (whose `method` must be that name)."""
    if cls.name in REGISTRY:
        raise ValueError(f"method {cls.name!r} is registered twice")
    if cls.config_class.method != cls.name:
        raise ValueError(f"method {cls.name!r}: its config_class {cls.config_class.__name__} configures "
                         f"{cls.config_class.method!r}")
    REGISTRY[cls.name] = cls
    return cls


def method_names(single_domain: Optional[bool] = None, sequence: Optional[bool] = None) -> List[str]:
    """Registered names (in registration order), optionally only those for one domain or for sequences."""
    return [name for name, cls in REGISTRY.items()
            if (single_domain is None or cls.single_domain == single_domain)
            and (sequence is None or cls.sequence == sequence)]


def create(name: str, options: Any, sequence: bool = False) -> "Method":
    """The method `name` configured from a runner's flat `options` (`MethodConfig.from_options`);
    MethodError for an unknown name, for a method that cannot learn a task sequence when
    `sequence` is asked for (or cannot run alone when not), or for an option it refuses."""
    if name not in REGISTRY:
        raise MethodError(f"unknown method {name!r}; choose one of {', '.join(method_names(None, sequence or None))}")
    cls = REGISTRY[name]
    if sequence and not cls.sequence:
        raise MethodError(f"method {name!r} does not learn task sequences; choose one of "
                          f"{', '.join(method_names(sequence=True))}")
    if not sequence and not cls.single_domain:
        raise MethodError(f"method {name!r} is for task sequences (adept-ext continual); choose one of "
                          f"{', '.join(method_names(single_domain=True))}")
    return get_method(cls.config_class.from_options(options))


def get_method(config: MethodConfig) -> "Method":
    """The registered method that `config` configures (e.g. `get_method(DealConfig(rank=4))`)."""
    if not isinstance(config, MethodConfig) or config.method not in REGISTRY:
        raise TypeError(f"get_method needs the config of a registered method (e.g. AdeptConfig()), "
                        f"got {type(config).__name__}")
    return REGISTRY[config.method](config)


@dataclass
class Context:
    """What a method may use to prepare a task, besides the model."""

    general_probe: Sequence[Dict[str, torch.Tensor]]   # general-domain probe batches (ADEPT's Stage 1 and 2)
    domain_probe: Sequence[Dict[str, torch.Tensor]] = ()  # the domain's (task's) probe batches (placements)
    progress: bool = True
    autocast_dtype: Optional[torch.dtype] = None         # the training's autocast dtype (None: fp32)
    task_index: int = 0                                  # 0-based position in the sequence (0 for `run`)
    diagnosis_batches: Optional[Callable[[], List[Dict[str, torch.Tensor]]]] = None  # LayerTracer inputs
    log: Callable = logger.info
    # The training the method prepares for (explicit: a method reads no runner's options).
    lr: float = field(default=3e-4, kw_only=True)           # base learning rate of the task
    weight_decay: float = field(default=0.01, kw_only=True)  # AdamW's decoupled weight decay
    total_steps: int = field(default=40, kw_only=True)       # optimizer steps the task will take
    seed: int = field(default=0, kw_only=True)               # the run's seed (replay's draws)


@dataclass
class Setup:
    """What a method trains for the current task and how."""

    trainable: List[torch.nn.Parameter]
    groups: List[Dict]                        # optimizer param groups
    layers: List[int] = field(default_factory=list)  # layers expanded or trained (numbering before the task)
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
    config_class: type = MethodConfig  # the method's options (`config_class.method` == `name`)
    description = ""
    takes_layers = False   # accepts k / --layers
    single_domain = True   # usable by `adept-ext run`
    sequence = False       # usable by `adept-ext continual`
    shardable = True       # trains a model sharded by FSDP2 (--parallel fsdp2); the runners unshard it before end_task
    trains_every_weight = False  # every linear weight trains (full fine-tuning, OSF): nothing to hold in 4 bits
    own_loss_terms = False  # `loss` adds terms `training_loss` does not (replay's distillation): no Trainer path
    dense_result = True  # a task ends with one dense model of what it learned (continual --merge-back moves it)

    def __init__(self, config: MethodConfig):
        self.config = config

    def check(self, model):
        """Options that depend on the model; raise MethodError before anything is changed."""

    def prepare(self, model, ctx: Context, layers: Optional[List[int]] = None) -> Setup:
        raise NotImplementedError

    def groups(self, trainable, ctx: Context) -> List[Dict]:
        """One param group with the task's lr and weight decay (`ctx`)."""
        return [{"params": trainable, "lr": ctx.lr, "weight_decay": ctx.weight_decay}]

    def extra_bytes(self, trainable: List[torch.nn.Parameter]) -> int:
        """Memory the method keeps through a task's steps besides the optimizer's (for the memory check; default 0)."""
        return 0

    def write_artifacts(self, out):
        """Write what `prepare` computed (JSON/PNG) into the run directory."""

    def attach(self, optimizer):
        """Install optimizer-step hooks once the optimizer exists."""

    def step_note(self) -> str:
        """What the next optimizer step will do besides updating (for the progress bar), or ""."""
        return ""

    def metrics(self) -> Dict[str, float]:
        """What the method reports to live tracking after each step (`--report-to`; default none)."""
        return {}

    def train_blocks(self, blocks: List[BlockSet], task_index: int) -> BlockSet:
        """The training blocks of task `task_index`, given every task's training blocks (default: its own)."""
        return blocks[task_index]

    def loss(self, model, batch, loss_implementation: str = "auto", num_items=None,
             micro_batches: int = 1) -> torch.Tensor:
        """The runners' training loss of one micro-batch: `training_loss` of the model's next-token
        loss (`lm_loss.next_token_loss`: fused on a plain linear head unless `loss_implementation`
        is "hf"; with `num_items`, the step's labelled tokens, this batch's share of the step's mean)
        over the step's `micro_batches`."""
        return self.training_loss(next_token_loss(model, batch, loss_implementation, num_items),
                                  getattr(model, "module", model), micro_batches)  # under DDP: the wrapped model

    def training_loss(self, token_loss: torch.Tensor, model, micro_batches: int = 1,
                      loss_scale: float = 1) -> torch.Tensor:
        """The training loss of one micro-batch, the one definition every loop uses (the runners'
        `loss`, `hf.MethodCallback.compute_loss`):

            token_loss + Σ_k penalty_k(model) / (micro_batches · loss_scale)

        A loop backpropagates `micro_batches` such losses per optimizer step, each multiplied by
        `loss_scale` (`transformers.Trainer` multiplies by its process count when it averages
        tokens across devices; the runners by 1), and the data-parallel engines average the ranks'
        gradients: each penalty then weighs 1 per optimizer step, whatever the accumulation and the
        number of processes, as the token loss's mean does."""
        for term in self.penalties(model):
            token_loss = token_loss + term / (micro_batches * loss_scale)
        return token_loss

    def penalties(self, model) -> List[torch.Tensor]:
        """The terms the method adds to the task loss (O-LoRA, DEAL; default none); they depend on
        the parameters only (`training_loss` adds them)."""
        return []

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
