"""EoupCT ("Estimating and Orthogonalizing Unknown Pre-training Gradients for Continual
Fine-tuning", NeurIPS 2026, arXiv 2609.30935, method section; docs/methods.md §2): a frozen teacher (θ⁰,
the model before the first task, as in the paper and the public code; or with `teacher=task_start`
the model as it was when the current task started), a trainable student (one rank-r LoRA adapter
kept across the whole sequence, by default the public code's rank 4, alpha 32 on the MLP gate
projections; or every parameter), and per optimizer step

    S = S(P_t)                            knowledge proxy: a soft prompt P_t [L, H] used directly as
                                          inputs_embeds (`embeds`) or continued for M positions by the
                                          teacher, e_m = Σ_i π_{m,i} W_emb,i, π = Gumbel-softmax_τ over
                                          its top-50 next-token logits (`gumbel`, Eq. 8 and App. D.5)
    L_pre(θ; S) = MSE(F_teacher(S), F_θ(S))   last hidden states (or logits)
    θ_virt = θ − α g_new;  P_t ← P_t + Adam step on ∇_P [L_pre(θ_virt; S(P)) − λ Σ_{i<t} cos²(g_pre(P), g_pre(P_i))]
                                          (every `proxy_every` steps, `proxy_steps` ascent steps)
    g_pre = ∇_θ L_pre(θ; S(P_t))          at the real θ, every step
    g̃ = Π g (memory of earlier tasks' directions, Eq. 9), conflict correction (App. A.2):
    if ⟨g̃_new, g̃_pre⟩ < 0: g̃_new ← g̃_new − (⟨g̃_new, g̃_pre⟩/‖g̃_pre‖²) g̃_pre;  .grad ← g̃_new + g̃_pre

and AdamW's actual update is projected again (`where="update"`, Adam-NSCL), because AdamW's
per-coordinate scaling moves a projected gradient's step back out of the null space.

Memory (Algorithm 1, our choice of directions): after a task its parameter change
θ_end − θ_start is added to a `GradientMemory` (`delta`, the default: it measured better than
`gpm` on the built-in sequence, docs/methods.md §2.1). The alternative `gpm` sums the raw task
gradients in 2·`directions` consecutive windows of steps and adds the strongest
`directions` principal directions of these sums (eigenvectors of their Gram matrix,
GPM's energy criterion).

The LoRA student's parameter space persists across tasks: after a task the adapter is merged
into the weights (a plain HF model to evaluate and save) and its A, B are kept; the next task
adds the adapter again with those A, B and subtracts their product from the weights, so the
function is unchanged and the stored directions keep their meaning. The teacher is the same
model called (torch.func.functional_call) with the adapter's B at zero (θ⁰: the base weights are
the original ones again once shifted) or as it was when the task started: no model copy. The
`full` student keeps a frozen deep copy of the model at the task start as teacher (one more
model in memory).
DDP (world size > 1) is not supported: a MethodError in `check`, before anything trains.
"""
import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import parallel
from ..models import held
from ..ops import conflict_correct_, null_space_coeffs
from ..projection import GradientMemory, NullSpaceProjector
from .base import Method, MethodConfig, MethodError, Setup, option, register, train_only
from .lora import lora_adapters, target_modules

CHOICES = {"student": ("lora", "full"), "proxy": ("gumbel", "embeds", "none"), "where": ("update", "grad"),
           "target": ("hidden", "logits"), "memory": ("gpm", "delta"), "teacher": ("auto", "base", "task_start")}
TOP_K = 50  # candidates of the Gumbel-softmax relaxation (App. D.5)


@dataclass(kw_only=True)
class EoupCTConfig(MethodConfig):
    """EoupCT's options (the runners' `eoupct_<field>`; `lam` is eoupct_lambda)."""

    method: ClassVar[str] = "eoupct"
    student: str = option("lora", "eoupct_student", help=(
        "student: lora (one rank-r adapter kept across tasks) or full (every parameter)"))
    rank: int = option(4, "eoupct_rank", help="LoRA rank of the student")
    lora_alpha: float = option(32.0, "eoupct_lora_alpha", help=(
        "LoRA alpha of the student, scaling alpha / rank (the public code's 32: scaling 8 at rank 4; 0: 2 × rank, "
        "scaling 2)"))
    target_modules: str = option("gate", "eoupct_target_modules", help=(
        "the student's projections: `gate` (the MLP gate projections, as the public code's `gate_proj`; every "
        "projection where the experts are fused), `all` (every attention and MLP projection of the family) or "
        "comma-separated names"))
    teacher: str = option("auto", "eoupct_teacher", help=(
        "the teacher: `base` (the model before the first task, as the paper and the public code), `task_start` "
        "(the model at the start of the current task) or `auto` (`base`; `task_start` for the full student)"))
    proxy: str = option("gumbel", "eoupct_proxy", help=(
        "knowledge proxy: gumbel (teacher-generated pseudo-sequence), embeds (the soft prompt as inputs_embeds, "
        "as the public code) or none"))
    proxy_len: int = option(16, "eoupct_proxy_len", help="soft prompt length L (4-32)")
    gen_steps: int = option(8, "eoupct_gen_steps", help="positions M the teacher generates from the prompt (gumbel)")
    tau: float = option(1.0, "eoupct_tau", help="Gumbel-softmax temperature")
    alpha: float = option(0.05, "eoupct_alpha", help="virtual step size: θ_virt = θ − α g_new")
    lam: float = option(0.1, "eoupct_lambda", help=(
        "weight λ of the cos² penalty against earlier tasks' proxy gradients"))
    proxy_every: int = option(4, "eoupct_proxy_every", help="optimise the soft prompt every N optimizer steps")
    proxy_steps: int = option(1, "eoupct_proxy_steps", help="prompt ascent steps each time")
    proxy_lr: float = option(1e-3, "eoupct_proxy_lr", help="Adam learning rate of the soft prompt")
    no_virtual: bool = option(False, "eoupct_no_virtual", help=(
        "ablation: optimise the prompt at θ instead of the virtual step θ_virt"))
    no_conflict: bool = option(False, "eoupct_no_conflict", help=(
        "ablation: no conflict correction (the plain sum of the projected gradients)"))
    where: str = option("update", "eoupct_where", help=(
        "project the optimizer's update (update, exact with AdamW) or only the gradients (grad)"))
    target: str = option("hidden", "eoupct_target", help=(
        "L_pre on the last hidden states (hidden) or on the logits (logits)"))
    directions: int = option(4, "eoupct_directions", help="directions added to the null-space memory per task (gpm)")
    memory: str = option("delta", "eoupct_memory", help=(
        "memory directions per task: delta (the task's parameter change) or gpm (the strongest directions of the "
        "task's gradients)"))

    def __post_init__(self):
        super().__post_init__()
        for name, allowed in CHOICES.items():
            self.require_one_of(name, allowed)
        self.require("proxy_len", 4 <= self.proxy_len <= 32, "must be in 4..32")
        for name in ("rank", "gen_steps", "proxy_every", "proxy_steps", "directions"):
            self.require(name, getattr(self, name) >= 1, "must be >= 1")
        for name in ("tau", "proxy_lr"):
            self.require(name, getattr(self, name) > 0, "must be > 0")
        for name in ("alpha", "lam", "lora_alpha"):
            self.require(name, getattr(self, name) >= 0, "must be >= 0")
        self.require("teacher", not (self.student == "full" and self.teacher == "base"),
                     "base needs the lora student (the full student's teacher is a copy of the model at the "
                     "start of each task: task_start)")
        self.require("target_modules", all(name.strip() for name in self.target_modules.split(",")),
                     "must be gate, all or a comma-separated list of projections")

    @property
    def teacher_is_base(self) -> bool:
        """Whether the teacher is θ⁰, the model before the first task (the paper's and the public
        code's), rather than the model at the start of the current task."""
        return self.teacher == "base" or (self.teacher == "auto" and self.student == "lora")


def student_targets(model, targets: str) -> List[str]:
    """The projections of the LoRA student: `gate` (the default, as the public code's gate_proj):
    the family's MLP gate projections (gate_proj; Phi-3's fused gate_up_proj), or every LoRA
    target of the family where the MLPs have none as a linear layer (fused experts: Mixtral,
    OLMoE); `all`: every LoRA target of the family; else the comma-separated names, each of which
    the model must have (docs/methods.md §2)."""
    def present(name):
        return any(n.endswith(f".{name}") for n, _ in model.named_modules())

    if targets in ("gate", "all"):
        family = target_modules(model)
        gates = [t for t in family if "gate" in t and present(t)]
        return gates if targets == "gate" and gates else family
    names = [name.strip() for name in targets.split(",")]
    missing = [t for t in names if not present(t)]
    if missing:
        raise MethodError(f"eoupct_target_modules: the model has no {', '.join(missing)} projections")
    return names


def _cpu(tensors):
    return [t.detach().cpu() for t in tensors]


def _dot(a, b) -> torch.Tensor:
    """⟨a, b⟩ over two tensor lists, differentiable (the prompt search differentiates through it)."""
    return sum((x.float() * y.float()).sum() for x, y in zip(a, b))


@register
class EoupCT(Method):
    name = "eoupct"
    config_class = EoupCTConfig
    description = "EoupCT: soft-prompt knowledge proxy, virtual step, null-space projection and conflict correction"
    single_domain = False
    sequence = True
    shardable = False  # no data parallelism at all (see `check`)

    def __init__(self, config):
        super().__init__(config)
        self.trains_every_weight = config.student == "full"
        # Kept across tasks (state_dict): the adapter at the start of the current task (the teacher),
        # the memory, and each finished task's proxy gradient g_pre(P_i) for the cos² penalty.
        self.adapter: Optional[Dict[str, torch.Tensor]] = None
        self.memory_state: Optional[Dict] = None
        self.proxy_grads: List[List[torch.Tensor]] = []
        self._reset_task()

    def _reset_task(self):
        self.model = self.peft_model = self.teacher = self.memory = self.prompt = self.prompt_opt = None
        self.base_adapter: Optional[Dict[str, torch.Tensor]] = None  # the LoRA student's θ⁰ (B = 0)
        self.trainable: List[torch.nn.Parameter] = []
        self.names: List[str] = []
        self.cache = None            # (S(P_t), F_teacher(S)) since the last prompt optimisation
        self.step = 0                # optimizer steps of this task
        self.total_steps = 0         # the steps it will take (ctx.total_steps): gpm's windows
        self.windows: List[List[torch.Tensor]] = []  # gpm: summed task gradients per window of steps
        self.last_pre: Optional[List[torch.Tensor]] = None
        self.base_shifted = False
        self._handles, self._projector = [], None

    def check(self, model):
        if parallel.world_size() > 1:
            raise MethodError("eoupct does not support data parallelism (torchrun with more than one process): "
                              "its per-step proxy gradient would differ between ranks")

    # ------------------------------------------------------------------ task setup
    def prepare(self, model, ctx, layers=None) -> Setup:
        c = self.config
        self.model, self.autocast, self.total_steps = model, ctx.autocast_dtype, ctx.total_steps
        if c.student == "lora":
            from peft import LoraConfig, get_peft_model

            r = c.rank
            targets = student_targets(model, c.target_modules)
            config = LoraConfig(r=r, lora_alpha=c.lora_alpha or 2 * r, lora_dropout=0.0, target_modules=targets)
            self.peft_model = get_peft_model(model, config)
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            if self.adapter is None:  # first task: PEFT's initialisation (B = 0), nothing merged yet
                self.adapter = {n: p.detach().clone() for n, p in named}
            else:
                self.adapter = {n: t.to(named[0][1].device) for n, t in self.adapter.items()}
                with torch.no_grad():
                    for n, p in named:
                        p.copy_(self.adapter[n])
                self._shift_base()
            # θ⁰: the base weights (equal to the original ones once shifted) with the adapter's B at 0
            self.base_adapter = {n: torch.zeros_like(t) if ".lora_B." in n else t for n, t in self.adapter.items()}
            summary = (f"trains one rank-{r} LoRA adapter (alpha {c.lora_alpha or 2 * r:g}, kept across tasks) on "
                       f"{', '.join(targets)} with EoupCT (teacher: "
                       f"{'the model before the first task' if c.teacher_is_base else 'the model at the task start'})")
        else:
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
            named = list(model.named_parameters())
            summary = "trains every parameter with EoupCT (teacher: a frozen copy)"
        self.names = [n for n, _ in named]
        self.trainable = train_only(model, [p for _, p in named])
        device = self.trainable[0].device
        k = self.memory_state["k"] if self.memory_state else 0
        self.memory = GradientMemory(self.trainable, max(1, k))
        if self.memory_state:
            self.memory.load_state_dict(self.memory_state)
        self.proxy_grads = [[g.to(device) for g in grads] for grads in self.proxy_grads]
        if c.proxy != "none":
            emb = model.get_input_embeddings().weight
            ids = torch.randint(0, emb.shape[0], (c.proxy_len,))
            self.prompt = emb.detach()[ids.to(emb.device)].clone().float().requires_grad_(True)
            self.prompt_opt = torch.optim.Adam([self.prompt], lr=c.proxy_lr)
        if c.memory == "gpm":
            self.windows = [[torch.zeros_like(p) for p in self.trainable] for _ in range(2 * c.directions)]
        return Setup(self.trainable, self.groups(self.trainable, ctx), [],
                     f"{summary}; proxy {c.proxy}, memory {k} directions")

    def _shift_base(self):
        """W ← W − scale·B₀A₀ for every adapted projection (B₀, A₀: the kept adapter, already merged
        into W): with the adapter re-added the model computes the same function as before."""
        with torch.no_grad():
            for name, layer in lora_adapters(self.model):
                a = self.adapter[f"{name}.lora_A.default.weight"]
                b = self.adapter[f"{name}.lora_B.default.weight"]
                w = layer.base_layer.weight  # shifted exactly where the runner holds it in bfloat16
                exact = held.exact_value(self.model, w).to(b.device)
                held.assign(self.model, w, exact.float() - (b @ a).float() * layer.scaling["default"])
        self.base_shifted = True

    def attach(self, optimizer):
        # Ours first: torch runs step pre-hooks in registration order, so .grad holds g̃_new* + g̃_pre
        # when the projector's pre-hook saves θ_old (it does not read .grad), and its post-hook
        # projects the change AdamW made from that direction.
        self._handles = [optimizer.register_step_pre_hook(self._before_step)]
        if self.config.where == "update":
            self._projector = NullSpaceProjector(optimizer, self.memory, where="update")

    def step_note(self) -> str:
        return "optimising the soft prompt" if self._prompt_due() else ""

    def _prompt_due(self) -> bool:
        return self.prompt is not None and self.step % self.config.proxy_every == 0

    # ------------------------------------------------------------------ the proxy
    def _features(self, out) -> torch.Tensor:
        return (out.hidden_states[-1] if self.config.target == "hidden" else out.logits).float()

    def _call(self, embeds, params=None, past=None):
        """The student (params None), the student at other trainable values (params: name → tensor),
        or the teacher (params "teacher"), on inputs_embeds; with a KV cache (past) for the teacher's
        generation. The logits of every position only when L_pre compares logits."""
        kwargs = dict(inputs_embeds=embeds, use_cache=params == "teacher", cache=past,
                      output_hidden_states=self.config.target == "hidden",
                      logits_to_keep=0 if self.config.target == "logits" else 1)
        bf16 = self.autocast is not None
        with torch.autocast(embeds.device.type, dtype=self.autocast or torch.float32, enabled=bf16):
            if params == "teacher":
                if self.teacher is not None:
                    return self.teacher(**kwargs)
                params = self.base_adapter if self.config.teacher_is_base else self.adapter
            return self.model(**kwargs) if params is None else functional_call(self.model, params, (), kwargs)

    def pseudo_sequence(self, prompt: torch.Tensor):
        """(S(P) [1, L (+M), H], F_teacher(S)): the prompt itself (`embeds`) or continued by the teacher
        for M positions with e_m = Σ_i π_i W_emb,i, π = softmax((top-50 logits + Gumbel noise)/τ)
        (`gumbel`; one position per call with a KV cache, the teacher's features of S collected on the
        way). Differentiable w.r.t. the prompt."""
        steps = self.config.gen_steps if self.config.proxy == "gumbel" else 0
        emb = (self.teacher or self.model).get_input_embeddings().weight
        pieces, features, past = [prompt[None]], [], None
        for m in range(steps + 1):
            out = self._call(pieces[-1].to(emb.dtype), "teacher", past)
            features.append(self._features(out))
            if m == steps:
                break
            values, index = out.logits[:, -1].float().topk(min(TOP_K, out.logits.shape[-1]), dim=-1)
            gumbel = -torch.empty_like(values).exponential_().log()
            pi = torch.softmax((values + gumbel) / self.config.tau, dim=-1)
            pieces.append(pi[:, None] @ emb[index].float())
            past = out.cache
        return torch.cat(pieces, dim=1), torch.cat(features, dim=1)

    def proxy_loss(self, seq: torch.Tensor, target: torch.Tensor, params=None) -> torch.Tensor:
        """L_pre(θ; S) = MSE(F_teacher(S), F_θ(S)) (θ: the student, or `params`)."""
        return F.mse_loss(self._features(self._call(seq, params)), target)

    def _optimise_prompt(self, g_new: List[torch.Tensor]):
        """Adam ascent on P_t of L_pre(θ_virt; S(P)) − λ Σ_{i<t} cos²(g_pre(P), g_pre(P_i)) with
        θ_virt = θ − α g_new (θ itself with `no_virtual`), then caches S(P_t) and its teacher
        features for the following steps. The student's weights are never written."""
        alpha = 0.0 if self.config.no_virtual else self.config.alpha
        penalty = self.config.lam > 0 and bool(self.proxy_grads)
        virt = {n: (p.detach() - alpha * g).requires_grad_(penalty)
                for n, p, g in zip(self.names, self.trainable, g_new)}
        for _ in range(self.config.proxy_steps):
            # The penalty differentiates through g_pre(P) (double backward): math attention has one.
            with sdpa_kernel([SDPBackend.MATH]) if penalty else nullcontext():
                objective = self.proxy_loss(*self.pseudo_sequence(self.prompt), virt)
                if penalty:
                    g = torch.autograd.grad(objective, list(virt.values()), create_graph=True, allow_unused=True)
                    g = [torch.zeros_like(v) if x is None else x for x, v in zip(g, virt.values())]
                    norm = _dot(g, g).clamp_min(1e-30)
                    cos2 = sum(_dot(g, old) ** 2 / (norm * _dot(old, old).clamp_min(1e-30)) for old in self.proxy_grads)
                    objective = objective - self.config.lam * cos2
                (grad,) = torch.autograd.grad(objective, [self.prompt])
            self.prompt.grad = -grad  # ascent
            self.prompt_opt.step()
        with torch.no_grad():
            self.cache = self.pseudo_sequence(self.prompt)

    # ------------------------------------------------------------------ the step
    def _before_step(self, optimizer, args, kwargs):
        """g_new in .grad (from the runner's backward) → .grad = g̃_new* + g̃_pre (see the module docstring)."""
        for p in self.trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        g_new = [p.grad for p in self.trainable]
        if self.windows:
            window = self.step * len(self.windows) // self.total_steps
            torch._foreach_add_(self.windows[min(window, len(self.windows) - 1)], g_new)
        if self.prompt is not None:
            if self._prompt_due() or self.cache is None:
                self._optimise_prompt(g_new)
            loss = self.proxy_loss(*self.cache)
            g_pre = torch.autograd.grad(loss, self.trainable, allow_unused=True)  # not .backward: .grad stays g_new
            g_pre = [torch.zeros_like(p) if g is None else g.contiguous() for g, p in zip(g_pre, self.trainable)]
            self.last_pre = g_pre
        self.memory.project_(g_new, check_finite=False)
        if self.prompt is not None:
            g_pre = [g.clone() for g in g_pre]
            self.memory.project_(g_pre, check_finite=False)
            if self.config.no_conflict:
                torch._foreach_add_(g_new, g_pre)
            else:
                conflict_correct_(g_new, g_pre, 1.0)  # branch on the device, then g_new += g_pre
        self.step += 1

    # ------------------------------------------------------------------ end of task
    def task_directions(self) -> List[List[torch.Tensor]]:
        """This task's directions for the memory: the `directions` strongest principal directions
        of the windowed gradient sums (gpm), or θ_end − θ_start (delta)."""
        if self.config.memory == "delta":
            start = ([self.adapter[n] for n in self.names] if self.teacher is None
                     else [dict(self.teacher.named_parameters())[n] for n in self.names])
            return [[p.detach() - s.to(p.device) for p, s in zip(self.trainable, start)]]
        stacked = [torch.stack([w[i] for w in self.windows]) for i in range(len(self.trainable))]
        gram = torch.stack([null_space_coeffs(stacked, [w.contiguous() for w in window]) for window in self.windows])
        values, vectors = torch.linalg.eigh((gram + gram.T) / 2)
        keep = [j for j in reversed(range(len(values))) if values[j] > 1e-10 * values[-1].clamp_min(1e-30)]
        keep = keep[:self.config.directions]
        return [[torch.tensordot(vectors[:, j].to(s.dtype), s, dims=1) for s in stacked] for j in keep]

    def end_task(self, model, out, report: Dict):
        device = self.trainable[0].device  # the host where the runner merges the held model's task
        self.windows = [[w.to(device) for w in window] for window in self.windows]
        for h in self._handles:
            h.remove()
        if self._projector is not None:
            self._projector.remove()
        directions = self.task_directions()
        memory = GradientMemory(self.trainable, self.memory.k + max(1, len(directions)))
        memory.load_state_dict(self.memory.state_dict())
        added = memory.add(directions) if directions else {"added": [], "dropped": []}
        self.memory_state = {k: (_cpu(v) if k == "storage" else v) for k, v in memory.state_dict().items()}
        if self.last_pre is not None:
            self.proxy_grads = [_cpu(g) for g in self.proxy_grads] + [_cpu(self.last_pre)]
        report["eoupct"] = {"memory_directions": memory.k, "added": len(added["added"]),
                            "dropped": len(added["dropped"])}
        if self.teacher is None:  # the next task starts from this adapter, merged into the weights now
            self.adapter = {n: p.detach().clone() for n, p in zip(self.names, self.trainable)}
            model = self.peft_model.merge_and_unload()
        self._reset_task()
        return super().end_task(model, out, report)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> Dict:
        state = {"adapter": None if self.adapter is None else {n: t.cpu() for n, t in self.adapter.items()},
                 "memory": self.memory_state, "proxy_grads": [_cpu(g) for g in self.proxy_grads]}
        if self.model is not None:  # inside a task
            state["task"] = {"step": self.step, "windows": [_cpu(w) for w in self.windows],
                             "prompt": None if self.prompt is None else self.prompt.detach().cpu(),
                             "prompt_opt": None if self.prompt_opt is None else self.prompt_opt.state_dict(),
                             "cache": None if self.cache is None else _cpu(self.cache),
                             "last_pre": None if self.last_pre is None else _cpu(self.last_pre)}
        return state

    def load_state_dict(self, state: Dict):
        self.adapter, self.memory_state = state["adapter"], state["memory"]
        self.proxy_grads = list(state["proxy_grads"])
        task = state.get("task")
        if task is None or self.model is None:
            return
        # Killed inside a task: prepare() ran before this state was known; finish what it could not do.
        device = self.trainable[0].device
        self.adapter = {n: t.to(device) for n, t in self.adapter.items()}
        if self.teacher is None and not self.base_shifted:
            self._shift_base()
        self.proxy_grads = [[g.to(device) for g in grads] for grads in self.proxy_grads]
        if self.memory_state:  # the memory does not change inside a task: the one from before it
            self.memory = GradientMemory(self.trainable, self.memory_state["k"])
            self.memory.load_state_dict(self.memory_state)
            if self._projector is not None:
                self._projector.memory = self.memory
        self.step = task["step"]
        for window, saved in zip(self.windows, task["windows"]):
            torch._foreach_copy_(window, [t.to(device) for t in saved])
        if task["prompt"] is not None:
            with torch.no_grad():
                self.prompt.copy_(task["prompt"])
            self.prompt_opt.load_state_dict(task["prompt_opt"])
        self.cache = None if task["cache"] is None else tuple(t.to(device) for t in task["cache"])
        self.last_pre = None if task["last_pre"] is None else [t.to(device) for t in task["last_pre"]]

