"""DEAL (NeurIPS 2025, arXiv 2509.18942, method section; docs/methods.md §4): continual
LoRA fine-tuning that filters the previous task's LoRA factors Y = X + D (Y = A or B) down to
their task core X̂ (knowledge retention) and adds the new task's knowledge with a small MLP on
top (controlled update): Y' = X̂ + MLP(X̂), loss = L_task + λ1‖θ_retain‖_a^a + λ2‖θ_update‖_b^b
(`DealConfig`: lambda1, a, lambda2, b; options deal_lambda1, deal_a, ...).

The LoRA carried across tasks: task 1 learns a plain rank-r PEFT LoRA (there is nothing to
retain yet); after every task its factors (A', B') are merged into the weights and kept, and are
the frozen Y of the next task. Task t's weights are W + s(B'A' − B₀A₀), with (A₀, B₀) the
previous factors (already merged into W) — a rank-2r PEFT LoRA
    lora_A = [ΔA; A₀],  lora_B = [B', ΔB]   (ΔY = Y' − Y₀, so lora_B·lora_A = B'A' − B₀A₀),
whose weights are parametrizations (torch.nn.utils.parametrize) of the frozen factors. Filter and
MLP start as exact zero residuals, so ΔA = ΔB = 0 and the output at the start of a task is the
previous model's exactly; PEFT's merge then leaves a plain checkpoint (zero inference cost).

The free path (`deal_new_rank` m > 0, default 8): the filter and update alone only reshape the
previous factors and cannot learn a new task, so from task 2 on a fresh rank-m LoRA term
(F_A Kaiming-uniform, F_B = 0: still exact at the start) is trained beside them —
lora_A = [ΔA; A₀; F_A], lora_B = [B', ΔB, F_Bᵀ] — and its factors are the next task's Y.
`deal_new_rank 0` is the paper's text alone.

The public code's variant (`deal_variant public_code`; docs/methods.md §4): from task 2 on, lora_B
stays task 1's and is frozen; lora_A (trainable, starting from the previous task's filtered A) is
filtered by a one-level 2-D Haar DWT whose approximation coefficients are scaled by θ (one per
coefficient, init 1), and an MLP with biases (Kaiming init, discarded after the task) acts on the
LoRA activations: h = W₀x + s·B₁·MLP_t(Ã_t x). Not function-preserving and not mergeable: the
base weights never change, the adapter is applied by forward hooks between tasks
(`PublicCodeAdapter`) and saved as `deal_adapter.safetensors` in each task's folder and by the
finished model's `save_pretrained`, beside the base weights; `load_adapter` puts it back on the
reloaded model. θ is folded into A after each task.
"""
from dataclasses import dataclass
from typing import ClassVar, Dict, List

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..base import MethodError, Setup, option, register, train_only
from ..lora import SeqLora, SeqLoraConfig, add_lora, lora_adapters
from .adapter_file import ADAPTER_FILE, PublicCodeAdapter, detach_adapter, load_adapter, mlp_on_output
from .filters import ActivationMLP, Factor, Haar2dFilter, HaarFilter, WaveletFilter

__all__ = ["ADAPTER_FILE", "Deal", "DealConfig", "load_adapter"]

FILTERS = ("wavelet", "haar")
FILTER_ON = ("ab", "a", "b")
VARIANTS = ("paper", "public_code")


@dataclass(kw_only=True)
class DealConfig(SeqLoraConfig):
    """The carried LoRA's rank r, the retention filter (which, on which factors, its scales) and
    the penalties' weights and exponents (a >= b >= 1)."""

    method: ClassVar[str] = "deal"
    rank: int = option(8, "deal_rank", help="LoRA rank")
    variant: str = option("paper", "deal_variant", help=(
        "paper (filtered and updated factors plus a fresh LoRA term, merged after each task) or public_code (the "
        "authors' code: B frozen at task 1's, a 2-D Haar θ on A, an MLP on the LoRA activations; not mergeable: "
        "the saved model is the base model with the adapter beside it, `deal_adapter.safetensors`, which "
        "`adept_ext.methods.deal.load_adapter` applies after `from_pretrained`)"))
    filter: str = option("wavelet", "deal_filter", help=(
        "knowledge-retention filter: wavelet (the paper's heat-kernel network) or haar (the public code's "
        "one-level Haar DWT)"))
    filter_on: str = option("ab", "deal_filter_on", help="LoRA matrices that are filtered and updated: ab, a or b")
    scales: int = option(3, "deal_scales", help="number of heat-kernel scales of the wavelet filter")
    new_rank: int = option(8, "deal_new_rank", help=(
        "rank of the fresh zero-initialised LoRA term the new task learns beside the filtered factors (0: none, "
        "the filter and update only)"))
    lambda1: float = option(0.01, "deal_lambda1", help="weight of the retention penalty ‖θ_retain‖_a^a")
    a: float = option(10.0, "deal_a", help="exponent a of the retention penalty (a >= b)")
    lambda2: float = option(0.001, "deal_lambda2", help="weight of the update penalty ‖θ_update‖_b^b")
    b: float = option(2.0, "deal_b", help="exponent b of the update penalty (>= 1)")

    def __post_init__(self):
        super().__post_init__()
        self.require_one_of("variant", VARIANTS)
        if self.variant == "public_code":
            changed = [self.option_name(n) for n, default in (("filter", "wavelet"), ("filter_on", "ab"), ("scales", 3),
                                                              ("new_rank", 8)) if getattr(self, n) != default]
            if changed:
                raise MethodError(f"{', '.join(changed)} configure(s) the paper's DEAL (deal_variant paper); "
                                  f"deal_variant public_code has its own filter (2-D Haar on A) and update (an MLP "
                                  f"on the LoRA activations)")
        self.require_one_of("filter", FILTERS)
        self.require_one_of("filter_on", FILTER_ON)
        self.require("scales", self.scales >= 1, "must be >= 1")
        self.require("new_rank", self.new_rank >= 0, "must be >= 0")
        for name in ("lambda1", "lambda2"):
            self.require(name, 0 <= getattr(self, name) < float("inf"), "must be a finite number >= 0")
        if not 1 <= self.b <= self.a < float("inf"):
            raise MethodError(f"deal_a >= deal_b >= 1 is needed (the retention norm at least as high as the "
                              f"update norm), got a = {self.a}, b = {self.b}")


@register
class Deal(SeqLora):
    records_subspaces = False  # its factors are kept by end_task itself
    name = "deal"
    config_class = DealConfig
    description = "DEAL: the previous LoRA filtered (wavelet kernels) and updated (MLP), merged after each task"
    shardable = False  # parametrized adapter factors and penalties on whole tensors

    def __init__(self, config):
        super().__init__(config)
        self.factors: Dict[str, tuple] = {}  # module name -> (A' [r, d_in], B' [d_out, r]) of the last task
        self.retain: List[nn.Parameter] = []
        self.updates: List[nn.Parameter] = []
        self.fresh: List[nn.Parameter] = []
        self.mlps: Dict[str, ActivationMLP] = {}  # public_code: module name -> the task's MLP
        self.hooks = []  # public_code: forward hooks of the task's MLPs (the adapter between tasks: PublicCodeAdapter)

    def prepare(self, model, ctx, layers=None) -> Setup:
        self.remove_hooks()
        detach_adapter(model)  # the public code's adapter of the last task (a new one is trained from its factors)
        if not self.factors:  # task 1: a plain LoRA
            return super().prepare(model, ctx, layers)
        if self.config.variant == "public_code":
            return self.prepare_public_code(model, ctx)
        config = self.config
        filter_cls = WaveletFilter if config.filter == "wavelet" else HaarFilter
        r, m = len(next(iter(self.factors.values()))[0]), config.new_rank  # the kept factors' rank, the fresh one's
        self.peft_model = add_lora(model, 2 * r + m, self.first_layer(ctx))  # scaling 2 as at rank r
        self.retain, self.updates, self.fresh = [], [], []
        for name, layer in lora_adapters(model):
            a0, b0 = (f.to(layer.lora_A["default"].weight) for f in self.factors[name])
            with torch.no_grad():
                lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                lora_a.copy_(torch.cat([torch.zeros_like(a0), a0, a0.new_zeros(m, a0.shape[1])]))
                lora_b.copy_(torch.cat([b0, torch.zeros_like(b0), b0.new_zeros(len(b0), m)], 1))
            for key, y0, is_b in (("a", a0, False), ("b", b0.T, True)):
                if key in config.filter_on or m:
                    factor = Factor(y0, is_b, filter_cls, config.scales, key in config.filter_on, m).to(y0)
                    parametrize.register_parametrization(layer.lora_B["default"] if is_b else layer.lora_A["default"],
                                                         "weight", factor)
                    if factor.filter is not None:
                        self.retain += list(factor.filter.parameters())
                        self.updates += list(factor.update.parameters())
                    if factor.fresh is not None:
                        self.fresh.append(factor.fresh)
        trainable = train_only(model, self.retain + self.updates + self.fresh)
        fresh = f" + a fresh rank-{m} LoRA term" if m else ""
        return Setup(trainable, self.groups(trainable, ctx), [],
                     f"DEAL ({config.filter} filter + MLP update on {config.filter_on.upper()}) of the previous "
                     f"rank-{r} LoRA{fresh} on {len(self.factors)} projections")

    def prepare_public_code(self, model, ctx) -> Setup:
        """Task t >= 2 of the public code's variant: lora_A = Haar2dFilter(A) (A from the last task,
        trainable), lora_B = task 1's B (frozen), a fresh ActivationMLP on lora_A's output."""
        r = len(next(iter(self.factors.values()))[0])
        self.peft_model = add_lora(model, r, self.first_layer(ctx))
        a_params, self.retain, self.updates, self.mlps = [], [], [], {}
        for name, layer in lora_adapters(model):
            lora_a, lora_b = layer.lora_A["default"], layer.lora_B["default"]
            a, b = (f.to(lora_a.weight) for f in self.factors[name])
            with torch.no_grad():
                lora_a.weight.copy_(a)
                lora_b.weight.copy_(b)
            haar = Haar2dFilter(a.shape).to(a)
            parametrize.register_parametrization(lora_a, "weight", haar)
            self.mlps[name] = ActivationMLP(r).to(a)
            self.hooks.append(lora_a.register_forward_hook(mlp_on_output(self.mlps[name])))
            a_params.append(lora_a.parametrizations.weight.original)
            self.retain.append(haar.theta)
            self.updates += list(self.mlps[name].parameters())
        trainable = train_only(model, a_params + self.retain + self.updates)
        return Setup(trainable, self.groups(trainable, ctx), [],
                     f"DEAL, the public code's variant (2-D Haar θ on A, MLP on the activations, B frozen) of the "
                     f"rank-{r} LoRA on {len(self.factors)} projections")

    def loss(self, model, batch, loss_implementation: str = "auto", num_items=None,
             micro_batches: int = 1) -> torch.Tensor:
        with parametrize.cached():  # each adapted factor computed once per forward
            return super().loss(model, batch, loss_implementation, num_items, micro_batches)

    def penalties(self, model) -> List[torch.Tensor]:
        """λ1·‖θ_retain‖_a^a and λ2·‖θ_update‖_b^b (docs/methods.md §4); in the public code's variant
        the norms themselves, λ1·‖θ‖_a + λ2·‖MLP‖_b, summed over the projections."""
        c = self.config
        if c.variant == "public_code":
            mlps = [torch.cat([p.flatten() for p in mlp.parameters()]) for mlp in self.mlps.values()]
            return [lam * sum(torch.linalg.vector_norm(t.flatten(), power) for t in tensors)
                    for tensors, lam, power in ((self.retain, c.lambda1, c.a), (mlps, c.lambda2, c.b))
                    if tensors and lam]
        return [lam * sum(p.abs().pow(power).sum() for p in params)
                for params, lam, power in ((self.retain, c.lambda1, c.a), (self.updates, c.lambda2, c.b))
                if params and lam]

    def end_task(self, model, out, report: Dict):
        """Keep the factors that learned this task as the next task's Y — the fresh term's (F_A, F_B)
        when there is one, else the adapted (A', B') — then merge (a plain model again). The public
        code's variant keeps (Ã, B) instead and returns the unmerged base model with the adapter
        applied by forward hooks (see `end_task_public_code`)."""
        if self.config.variant == "public_code":
            return self.end_task_public_code(model, out, report)
        with torch.no_grad():
            for name, layer in lora_adapters(model):
                a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                if name in self.factors:  # [ΔA; A₀; F_A] and [B', ΔB, F_Bᵀ]
                    r = len(self.factors[name][0])
                    a, b = (a[2 * r:], b[:, 2 * r:]) if self.config.new_rank else (a[:r] + a[r:2 * r], b[:, :r])
                self.factors[name] = (a.float().cpu().clone(), b.float().cpu().clone())
        self.retain, self.updates, self.fresh = [], [], []
        return super().end_task(model, out, report)

    def end_task_public_code(self, model, out, report: Dict):
        """Fold θ into A (Ã is the next task's A), unload the LoRA without merging, and attach the
        `PublicCodeAdapter` h = W₀x + s·B·MLP_t(Ã x) to the base model (no MLP after task 1): its
        forward hooks apply it for evaluation until the next task, which discards MLP_t as the
        public code does, and the returned model's save_pretrained writes it beside the weights.
        Writes the adapter (A, B, the MLP's weights, the scaling) to `out/deal_adapter.safetensors`
        too."""
        adapters = lora_adapters(self.peft_model.get_base_model())  # names as in the plain model
        scaling = adapters[0][1].scaling["default"]
        with torch.no_grad():
            for name, layer in adapters:
                a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # Ã: θ applied
                self.factors[name] = (a.detach().float().cpu().clone(), b.detach().float().cpu().clone())
        self.remove_hooks()
        base = self.peft_model.unload()
        self.peft_model = None
        adapter = PublicCodeAdapter(self.factors, self.mlps, scaling)
        adapter.attach(base)
        if out is not None:
            adapter.save(out / ADAPTER_FILE)
            report["adapter"] = (f"{ADAPTER_FILE} (not mergeable: beside the base weights in the saved model; "
                                 f"adept_ext.methods.deal.load_adapter applies it)")
        self.retain, self.updates = [], []
        return base

    def remove_hooks(self):
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def state_dict(self) -> Dict:
        return {"factors": dict(self.factors)}

    def load_state_dict(self, state: Dict):
        self.factors = dict(state["factors"])
