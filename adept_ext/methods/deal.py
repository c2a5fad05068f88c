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
import copy
import math
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..errors import InputError
from .base import MethodError, Setup, option, register, train_only
from .lora import SeqLora, SeqLoraConfig, add_lora, lora_adapters

FILTERS = ("wavelet", "haar")
FILTER_ON = ("ab", "a", "b")
VARIANTS = ("paper", "public_code")
ADAPTER_FILE = "deal_adapter.safetensors"  # deal_variant public_code: the task's adapter (not mergeable)
ADAPTER_ATTR = "deal_adapter"  # the PublicCodeAdapter a model carries (a plain attribute, not a submodule)


class WaveletFilter(nn.Module):
    """The paper's retention filter on a factor Y [r, n] = U diag(s) Vᵀ: a learned shrinkage of its
    spectrum by a multi-scale network of heat kernels φ_j(s̃) = exp(−(s̃ − c_j)²/2σ_j²) on the
    normalised singular values s̃ = s/max(s), with learnable centres c_j = c_j⁰ + δ_j (c⁰ evenly
    spaced on [0, 1]) and diagonal gains g_j (one per singular component), σ_j = 2^−(j+1):
        X̂ = U diag(s_k (1 + Σ_j g_jk φ_j(s̃_k))) Vᵀ
    — the learnable form of the minimum-variance estimate Σ_k (σ_k² − σ_D²)/σ_k u_k v_kᵀ. θ_retain
    = {g, δ}, both 0 at the start, where the residual X̂ − Y it returns is exactly 0."""

    def __init__(self, y: torch.Tensor, scales: int):
        super().__init__()
        u, s, vh = torch.linalg.svd(y.detach().float(), full_matrices=False)
        for name, value in (("u", u), ("s", s), ("vh", vh), ("s_norm", s / s.max().clamp_min(1e-12)),
                            ("widths", 2.0 ** -torch.arange(2, scales + 2, dtype=torch.float32)),
                            ("centres", torch.linspace(0.0, 1.0, scales))):
            self.register_buffer(name, value, persistent=False)
        self.shifts = nn.Parameter(torch.zeros(scales))
        self.gains = nn.Parameter(torch.zeros(scales, len(s)))

    def forward(self) -> torch.Tensor:
        centres = self.centres + self.shifts
        phi = torch.exp(-(self.s_norm - centres[:, None]).square() / (2 * self.widths[:, None].square()))
        return (self.u * (self.s * (self.gains * phi).sum(0))) @ self.vh


class HaarFilter(nn.Module):
    """The public code's simplification: a one-level Haar DWT of Y [r, n] along n whose
    approximation coefficients are scaled by 1 + θ_k (one per rank component) before the inverse
    DWT. The inverse is linear, so the residual is θ_k times the pairwise means of Y (columns 2i,
    2i+1; an odd last column is left alone); exactly 0 at the start (θ = 0)."""

    def __init__(self, y: torch.Tensor, scales: int):
        super().__init__()
        y = y.detach().float()
        pairs = y.shape[1] // 2 * 2
        means = torch.zeros_like(y)
        means[:, :pairs] = y[:, :pairs].reshape(len(y), -1, 2).mean(-1).repeat_interleave(2, dim=1)
        self.register_buffer("means", means, persistent=False)
        self.theta = nn.Parameter(torch.zeros(len(y)))

    def forward(self) -> torch.Tensor:
        return self.theta[:, None] * self.means


class Update(nn.Module):
    """The controlled update: an MLP x ↦ B relu(Ω x), r → max(128, r/2) → r, on each r-vector x of
    X̂ (a column of A, a row of B); θ_update = {Ω, B}. B starts at zero, so the residual starts at
    0. No biases: a bias adds the same vector to every column of A (row of B) — an update along
    the all-ones input (output) direction that dominates at LoRA's scale (docs/methods.md §4)."""

    def __init__(self, r: int):
        super().__init__()
        self.inner = nn.Linear(r, max(128, r // 2), bias=False)
        self.outer = nn.Linear(self.inner.out_features, r, bias=False)
        nn.init.zeros_(self.outer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [r, n] -> [r, n]
        return self.outer(torch.relu(self.inner(x.T))).T


class Haar2dFilter(nn.Module):
    """The public code's filter of lora_A (a parametrization of A [r, d_in]): pytorch_wavelets'
    one-level 2-D Haar DWT (zero padding) of A, its approximation coefficients cA (2×2 block sums / 2)
    scaled by θ (one per coefficient, init 1), the details kept, and the inverse DWT. The inverse is
    linear and puts cA/2 on each entry of its block, so Ã = A + upsample((θ − 1) ⊙ blocksum(A) / 4)."""

    def __init__(self, shape):
        super().__init__()
        self.theta = nn.Parameter(torch.ones((shape[0] + 1) // 2, (shape[1] + 1) // 2))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        r, d = a.shape
        blocks = F.pad(a, (0, d % 2, 0, r % 2)).reshape(len(self.theta), 2, -1, 2).sum((1, 3))
        change = ((self.theta - 1) * blocks / 4).repeat_interleave(2, 0).repeat_interleave(2, 1)
        return a + change[:r, :d]


class ActivationMLP(nn.Module):
    """The public code's update on the LoRA activations z = Ã x: fc2(relu(fc1(z))), r → max(128, r/2)
    → r, with biases; weights Kaiming-uniform (ReLU gain), biases 0; no residual."""

    def __init__(self, r: int):
        super().__init__()
        self.fc1 = nn.Linear(r, max(128, r // 2))
        self.fc2 = nn.Linear(self.fc1.out_features, r)
        for layer in (self.fc1, self.fc2):
            nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(z)))


def _mlp_on_output(mlp):
    """A forward hook that replaces a module's output z by mlp(z)."""
    return lambda module, inputs, output: mlp(output)


def _adapter_on_output(a, b, scaling, mlp):
    """A forward hook adding s·B·MLP(A x) (s·B·A x without an MLP) to a projection's output, on the
    input's device (the adapter is attached where the task ends, on the host under held weights)."""
    placed = {}

    def hook(module, inputs, output):
        x = inputs[0]
        if x.device not in placed:
            moved = copy.deepcopy(mlp).to(x.device) if mlp is not None else None
            placed[x.device] = a.to(x.device), b.to(x.device), moved
        a_, b_, mlp_ = placed[x.device]
        z = F.linear(x.to(a_.dtype), a_)
        return output + scaling * F.linear(mlp_(z) if mlp_ is not None else z, b_).to(output.dtype)
    return hook


class PublicCodeAdapter:
    """The public code's adapter between tasks, on the plain (unmerged) model: h = W₀x + s·B·MLP(Ã x)
    on each adapted projection (s·B·Ã x after task 1, which has no MLP), applied by forward hooks.
    `factors`: module name -> (Ã [r, d_in], B [d_out, r]), float32; `mlps`: module name -> the
    task's ActivationMLP (float32, frozen). While attached, the model's `save_pretrained` writes it
    beside the weights as ADAPTER_FILE (and `deal_adapter` into config.json): a saved model is
    never the base model alone. `load_adapter` reads it back."""

    def __init__(self, factors: Dict[str, tuple], mlps: Dict[str, nn.Module], scaling: float):
        self.factors, self.scaling = dict(factors), float(scaling)
        self.mlps = {name: mlp.float().requires_grad_(False) for name, mlp in mlps.items()}
        self.handles = []

    def tensors(self) -> Dict[str, torch.Tensor]:
        tensors = {f"{name}.{key}": t.detach().float().cpu().contiguous() for name, (a, b) in self.factors.items()
                   for key, t in (("lora_A", a), ("lora_B", b))}
        tensors.update({f"{name}.mlp.{k}": v.detach().float().cpu().contiguous()
                        for name, mlp in self.mlps.items() for k, v in mlp.state_dict().items()})
        return tensors

    def save(self, path: Path):
        """Write the adapter (A, B, the MLP's weights; the scaling in the metadata) to `path`."""
        from safetensors.torch import save_file

        save_file(self.tensors(), str(path), metadata={"scaling": str(self.scaling)})

    @classmethod
    def read(cls, path: Path) -> "PublicCodeAdapter":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            scaling = (f.metadata() or {}).get("scaling")
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        if scaling is None:
            raise InputError(f"{path}: not a DEAL adapter (no scaling in its metadata)")
        names = [key.removesuffix(".lora_A") for key in tensors if key.endswith(".lora_A")]
        if not names or any(f"{name}.lora_B" not in tensors for name in names):
            raise InputError(f"{path}: not a DEAL adapter (lora_A and lora_B of each projection expected)")
        mlps = {}
        for name in names:
            state = {k.removeprefix(f"{name}.mlp."): v for k, v in tensors.items() if k.startswith(f"{name}.mlp.")}
            if state:
                mlps[name] = ActivationMLP(len(tensors[f"{name}.lora_A"]))
                mlps[name].load_state_dict(state)
        return cls({name: (tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"]) for name in names}, mlps,
                   float(scaling))

    def attach(self, model):
        """Hook the adapter onto `model`'s projections (replacing one it carries) and make its
        save_pretrained write the adapter too."""
        modules = dict(model.named_modules())
        misfits = [name for name, (a, b) in self.factors.items() if name not in modules
                   or tuple(modules[name].weight.shape) != (b.shape[0], a.shape[1])]
        if misfits:
            raise InputError(f"the DEAL adapter does not fit this model: projections {misfits[:3]} are missing or "
                             f"of another shape")
        detach_adapter(model)
        for name, (a, b) in self.factors.items():
            device = modules[name].weight.device
            self.factors[name] = a, b = a.to(device), b.to(device)
            mlp = self.mlps[name].to(device) if name in self.mlps else None
            self.handles.append(modules[name].register_forward_hook(_adapter_on_output(a, b, self.scaling, mlp)))
        setattr(model, ADAPTER_ATTR, self)
        model.save_pretrained = types.MethodType(_save_with_adapter, model)

    def detach(self, model):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for attribute in (ADAPTER_ATTR, "save_pretrained"):
            vars(model).pop(attribute, None)


def detach_adapter(model):
    """Take the public code's adapter off `model`, if it carries one (hooks and saving)."""
    adapter = vars(model).get(ADAPTER_ATTR)
    if adapter is not None:
        adapter.detach(model)


def _save_with_adapter(model, save_directory, *args, **kwargs):
    """save_pretrained of a model carrying a PublicCodeAdapter: the base weights and config (which
    names the adapter file), then the adapter beside them."""
    config, had = model.config, "deal_adapter" in vars(model.config)
    previous = vars(config).get("deal_adapter")
    config.deal_adapter = ADAPTER_FILE
    try:
        result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
    finally:
        if had:
            config.deal_adapter = previous
        else:
            del config.deal_adapter
    if kwargs.get("is_main_process", True):
        getattr(model, ADAPTER_ATTR).save(Path(save_directory) / ADAPTER_FILE)
    return result


def load_adapter(model, path):
    """Put back the adapter of DEAL's public_code variant that `save_pretrained` wrote beside a
    finished model's weights (`path`: that folder or the file itself):

        model = AutoModelForCausalLM.from_pretrained(folder)  # the base weights alone
        load_adapter(model, folder)                            # the model `task.finish()` returned

    Returns `model`, its forward hooked as after `finish()` and its save_pretrained writing the
    adapter again. InputError when there is no adapter or it does not fit the model."""
    path = Path(path)
    if path.is_dir():
        path = path / ADAPTER_FILE
    if not path.is_file():
        raise InputError(f"{path}: no DEAL adapter here (deal_variant public_code writes {ADAPTER_FILE} beside the "
                         f"weights)")
    PublicCodeAdapter.read(path).attach(model)
    return model


class Factor(nn.Module):
    """Parametrization of one PEFT factor from the frozen Y₀ (rank-major [r, n]): the filtered and
    updated residual ΔY = (X̂ − Y₀) + MLP(X̂) (when this factor is filtered, else 0) and the fresh
    term's factor F (when `new_rank` > 0). For lora_A [2r + m, d_in] = [ΔA; A₀; F_A]; for
    lora_B [d_out, 2r + m] = [B', ΔB, F_Bᵀ]. F_A starts as PEFT's lora_A (Kaiming-uniform), F_B at 0."""

    def __init__(self, y0: torch.Tensor, is_b: bool, filter_cls, scales: int, filtered: bool, new_rank: int):
        super().__init__()
        self.is_b, self.r = is_b, y0.shape[0]
        self.filter = filter_cls(y0, scales) if filtered else None
        self.update = Update(self.r) if filtered else None
        fresh = torch.zeros(new_rank, y0.shape[1])
        if not is_b:
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5))
        self.fresh = nn.Parameter(fresh) if new_rank else None

    def delta(self, y0: torch.Tensor) -> torch.Tensor:
        if self.filter is None:
            return torch.zeros_like(y0)
        filtered = self.filter()
        return filtered + self.update(y0 + filtered)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        fresh = [] if self.fresh is None else [self.fresh]
        if self.is_b:
            y0 = weight[:, :self.r]
            d = self.delta(y0.T).T
            return torch.cat([y0 + d, d] + [f.T for f in fresh], 1)
        y0 = weight[self.r:2 * self.r]
        return torch.cat([self.delta(y0), y0] + fresh)


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
            self.hooks.append(lora_a.register_forward_hook(_mlp_on_output(self.mlps[name])))
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
