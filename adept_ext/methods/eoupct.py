"""EoupCT ("Estimating and Orthogonalizing Unknown Pre-training Gradients for Continual
Fine-tuning", NeurIPS 2026, arXiv 2609.30935, method section; docs/methods.md §2): a frozen teacher (the
model as it was when the current task started), a trainable student (one rank-r LoRA adapter
kept across the whole sequence, or every parameter), and per optimizer step

    S = S(P_t)                            knowledge proxy: a soft prompt P_t [L, H] used directly as
                                          inputs_embeds (`embeds`) or continued for M positions by the
                                          teacher, e_m = Σ_i π_{m,i} W_emb,i, π = Gumbel-softmax_τ over
                                          its top-50 next-token logits (`gumbel`, Eq. 8 and App. D.5)
    L_pre(θ; S) = MSE(F_teacher(S), F_θ(S))   last hidden states (or logits)
    θ_virt = θ − α g_new;  P_t ← P_t + Adam step on ∇_P [L_pre(θ_virt; S(P)) − λ Σ_{i<t} cos²(g_pre(P), g_pre(P_i))]
                                          (every `eoupct_proxy_every` steps, `eoupct_proxy_steps` ascent steps)
    g_pre = ∇_θ L_pre(θ; S(P_t))          at the real θ, every step
    g̃ = Π g (memory of earlier tasks' directions, Eq. 9), conflict correction (App. A.2):
    if ⟨g̃_new, g̃_pre⟩ < 0: g̃_new ← g̃_new − (⟨g̃_new, g̃_pre⟩/‖g̃_pre‖²) g̃_pre;  .grad ← g̃_new + g̃_pre

and AdamW's actual update is projected again (`where="update"`, Adam-NSCL), because AdamW's
per-coordinate scaling moves a projected gradient's step back out of the null space.

Memory (Algorithm 1, our choice of directions): after a task its parameter change
θ_end − θ_start is added to a `GradientMemory` (`delta`, the default: it measured better than
`gpm` on the built-in sequence, docs/methods.md §2.1). The alternative `gpm` sums the raw task
gradients in 2·`eoupct_directions` consecutive windows of steps and adds the strongest
`eoupct_directions` principal directions of these sums (eigenvectors of their Gram matrix,
GPM's energy criterion).

The LoRA student's parameter space persists across tasks: after a task the adapter is merged
into the weights (a plain HF model to evaluate and save) and its A, B are kept; the next task
adds the adapter again with those A, B and subtracts their product from the weights, so the
function is unchanged and the stored directions keep their meaning. The teacher is the same
model called (torch.func.functional_call) with the adapter as it was when the task started: no
model copy. The `full` student keeps a frozen deep copy as teacher (one more model in memory).
DDP (world size > 1) is not supported: a MethodError in `check`, before anything trains.
"""
import copy
from contextlib import nullcontext
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import parallel
from ..ops import conflict_correct_, null_space_coeffs
from ..projection import GradientMemory, NullSpaceProjector
from .base import Method, MethodError, Setup, register, train_only
from .lora import TARGET_MODULES, lora_adapters

CHOICES = {"eoupct_student": ("lora", "full"), "eoupct_proxy": ("gumbel", "embeds", "none"),
           "eoupct_where": ("update", "grad"), "eoupct_target": ("hidden", "logits"),
           "eoupct_memory": ("gpm", "delta")}
TOP_K = 50  # candidates of the Gumbel-softmax relaxation (App. D.5)


def _cpu(tensors):
    return [t.detach().cpu() for t in tensors]


def _dot(a, b) -> torch.Tensor:
    """⟨a, b⟩ over two tensor lists, differentiable (the prompt search differentiates through it)."""
    return sum((x.float() * y.float()).sum() for x, y in zip(a, b))


@register
class EoupCT(Method):
    name = "eoupct"
    description = "EoupCT: soft-prompt knowledge proxy, virtual step, null-space projection and conflict correction"
    single_domain = False
    sequence = True
    shardable = False  # no data parallelism at all (see `check`)

    def __init__(self, cfg):
        super().__init__(cfg)
        for option, allowed in CHOICES.items():
            if getattr(cfg, option) not in allowed:
                raise MethodError(f"{option} must be one of {', '.join(allowed)}, got {getattr(cfg, option)!r}")
        if not 4 <= cfg.eoupct_proxy_len <= 32:
            raise MethodError(f"eoupct_proxy_len must be in 4..32, got {cfg.eoupct_proxy_len}")
        for option in ("eoupct_rank", "eoupct_gen_steps", "eoupct_proxy_every", "eoupct_proxy_steps",
                       "eoupct_directions"):
            if getattr(cfg, option) < 1:
                raise MethodError(f"{option} must be >= 1, got {getattr(cfg, option)}")
        for option in ("eoupct_tau", "eoupct_proxy_lr"):
            if not getattr(cfg, option) > 0:
                raise MethodError(f"{option} must be > 0, got {getattr(cfg, option)}")
        for option in ("eoupct_alpha", "eoupct_lambda"):
            if not getattr(cfg, option) >= 0:
                raise MethodError(f"{option} must be >= 0, got {getattr(cfg, option)}")
        # Kept across tasks (state_dict): the adapter at the start of the current task (the teacher),
        # the memory, and each finished task's proxy gradient g_pre(P_i) for the cos² penalty.
        self.adapter: Optional[Dict[str, torch.Tensor]] = None
        self.memory_state: Optional[Dict] = None
        self.proxy_grads: List[List[torch.Tensor]] = []
        self._reset_task()

    def _reset_task(self):
        self.model = self.peft_model = self.teacher = self.memory = self.prompt = self.prompt_opt = None
        self.trainable: List[torch.nn.Parameter] = []
        self.names: List[str] = []
        self.cache = None            # (S(P_t), F_teacher(S)) since the last prompt optimisation
        self.step = 0                # optimizer steps of this task
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
        self.model, self.autocast = model, ctx.autocast_dtype
        if self.cfg.eoupct_student == "lora":
            from peft import LoraConfig, get_peft_model

            r = self.cfg.eoupct_rank
            config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGET_MODULES)
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
            summary = f"trains one rank-{r} LoRA adapter (kept across tasks) with EoupCT"
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
        if self.cfg.eoupct_proxy != "none":
            emb = model.get_input_embeddings().weight
            ids = torch.randint(0, emb.shape[0], (self.cfg.eoupct_proxy_len,))
            self.prompt = emb.detach()[ids.to(emb.device)].clone().float().requires_grad_(True)
            self.prompt_opt = torch.optim.Adam([self.prompt], lr=self.cfg.eoupct_proxy_lr)
        if self.cfg.eoupct_memory == "gpm":
            self.windows = [[torch.zeros_like(p) for p in self.trainable]
                            for _ in range(2 * self.cfg.eoupct_directions)]
        return Setup(self.trainable, self.groups(self.trainable), [],
                     f"{summary}; proxy {self.cfg.eoupct_proxy}, memory {k} directions")

    def _shift_base(self):
        """W ← W − scale·B₀A₀ for every adapted projection (B₀, A₀: the kept adapter, already merged
        into W): with the adapter re-added the model computes the same function as before."""
        with torch.no_grad():
            for name, layer in lora_adapters(self.model):
                a = self.adapter[f"{name}.lora_A.default.weight"]
                b = self.adapter[f"{name}.lora_B.default.weight"]
                w = layer.base_layer.weight
                w.sub_(((b @ a) * layer.scaling["default"]).to(w.dtype))
        self.base_shifted = True

    def attach(self, optimizer):
        # Ours first: torch runs step pre-hooks in registration order, so .grad holds g̃_new* + g̃_pre
        # when the projector's pre-hook saves θ_old (it does not read .grad), and its post-hook
        # projects the change AdamW made from that direction.
        self._handles = [optimizer.register_step_pre_hook(self._before_step)]
        if self.cfg.eoupct_where == "update":
            self._projector = NullSpaceProjector(optimizer, self.memory, where="update")

    def step_note(self) -> str:
        return "optimising the soft prompt" if self._prompt_due() else ""

    def _prompt_due(self) -> bool:
        return self.prompt is not None and self.step % self.cfg.eoupct_proxy_every == 0

    # ------------------------------------------------------------------ the proxy
    def _features(self, out) -> torch.Tensor:
        return (out.hidden_states[-1] if self.cfg.eoupct_target == "hidden" else out.logits).float()

    def _call(self, embeds, params=None, past=None):
        """The student (params None), the student at other trainable values (params: name → tensor),
        or the teacher (params "teacher"), on inputs_embeds; with a KV cache (past) for the teacher's
        generation. The logits of every position only when L_pre compares logits."""
        kwargs = dict(inputs_embeds=embeds, use_cache=params == "teacher", cache=past,
                      output_hidden_states=self.cfg.eoupct_target == "hidden",
                      logits_to_keep=0 if self.cfg.eoupct_target == "logits" else 1)
        bf16 = self.autocast is not None
        with torch.autocast(embeds.device.type, dtype=self.autocast or torch.float32, enabled=bf16):
            if params == "teacher":
                if self.teacher is not None:
                    return self.teacher(**kwargs)
                params = self.adapter
            return self.model(**kwargs) if params is None else functional_call(self.model, params, (), kwargs)

    def pseudo_sequence(self, prompt: torch.Tensor):
        """(S(P) [1, L (+M), H], F_teacher(S)): the prompt itself (`embeds`) or continued by the teacher
        for M positions with e_m = Σ_i π_i W_emb,i, π = softmax((top-50 logits + Gumbel noise)/τ)
        (`gumbel`; one position per call with a KV cache, the teacher's features of S collected on the
        way). Differentiable w.r.t. the prompt."""
        steps = self.cfg.eoupct_gen_steps if self.cfg.eoupct_proxy == "gumbel" else 0
        emb = (self.teacher or self.model).get_input_embeddings().weight
        pieces, features, past = [prompt[None]], [], None
        for m in range(steps + 1):
            out = self._call(pieces[-1].to(emb.dtype), "teacher", past)
            features.append(self._features(out))
            if m == steps:
                break
            values, index = out.logits[:, -1].float().topk(min(TOP_K, out.logits.shape[-1]), dim=-1)
            gumbel = -torch.empty_like(values).exponential_().log()
            pi = torch.softmax((values + gumbel) / self.cfg.eoupct_tau, dim=-1)
            pieces.append(pi[:, None] @ emb[index].float())
            past = out.cache
        return torch.cat(pieces, dim=1), torch.cat(features, dim=1)

    def proxy_loss(self, seq: torch.Tensor, target: torch.Tensor, params=None) -> torch.Tensor:
        """L_pre(θ; S) = MSE(F_teacher(S), F_θ(S)) (θ: the student, or `params`)."""
        return F.mse_loss(self._features(self._call(seq, params)), target)

    def _optimise_prompt(self, g_new: List[torch.Tensor]):
        """Adam ascent on P_t of L_pre(θ_virt; S(P)) − λ Σ_{i<t} cos²(g_pre(P), g_pre(P_i)) with
        θ_virt = θ − α g_new (θ itself with eoupct_no_virtual), then caches S(P_t) and its teacher
        features for the following steps. The student's weights are never written."""
        alpha = 0.0 if self.cfg.eoupct_no_virtual else self.cfg.eoupct_alpha
        penalty = self.cfg.eoupct_lambda > 0 and bool(self.proxy_grads)
        virt = {n: (p.detach() - alpha * g).requires_grad_(penalty)
                for n, p, g in zip(self.names, self.trainable, g_new)}
        for _ in range(self.cfg.eoupct_proxy_steps):
            # The penalty differentiates through g_pre(P) (double backward): math attention has one.
            with sdpa_kernel([SDPBackend.MATH]) if penalty else nullcontext():
                objective = self.proxy_loss(*self.pseudo_sequence(self.prompt), virt)
                if penalty:
                    g = torch.autograd.grad(objective, list(virt.values()), create_graph=True, allow_unused=True)
                    g = [torch.zeros_like(v) if x is None else x for x, v in zip(g, virt.values())]
                    norm = _dot(g, g).clamp_min(1e-30)
                    cos2 = sum(_dot(g, old) ** 2 / (norm * _dot(old, old).clamp_min(1e-30)) for old in self.proxy_grads)
                    objective = objective - self.cfg.eoupct_lambda * cos2
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
            window = self.step * len(self.windows) // self.cfg.steps
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
            if self.cfg.eoupct_no_conflict:
                torch._foreach_add_(g_new, g_pre)
            else:
                conflict_correct_(g_new, g_pre, 1.0)  # branch on the device, then g_new += g_pre
        self.step += 1

    # ------------------------------------------------------------------ end of task
    def task_directions(self) -> List[List[torch.Tensor]]:
        """This task's directions for the memory: the `eoupct_directions` strongest principal directions
        of the windowed gradient sums (gpm), or θ_end − θ_start (delta)."""
        if self.cfg.eoupct_memory == "delta":
            start = ([self.adapter[n] for n in self.names] if self.teacher is None
                     else [dict(self.teacher.named_parameters())[n] for n in self.names])
            return [[p.detach() - s for p, s in zip(self.trainable, start)]]
        stacked = [torch.stack([w[i] for w in self.windows]) for i in range(len(self.trainable))]
        gram = torch.stack([null_space_coeffs(stacked, [w.contiguous() for w in window]) for window in self.windows])
        values, vectors = torch.linalg.eigh((gram + gram.T) / 2)
        keep = [j for j in reversed(range(len(values))) if values[j] > 1e-10 * values[-1].clamp_min(1e-30)]
        keep = keep[:self.cfg.eoupct_directions]
        return [[torch.tensordot(vectors[:, j].to(s.dtype), s, dims=1) for s in stacked] for j in keep]

    def end_task(self, model, out, report: Dict):
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

