"""DEAL's retention filters and controlled update (docs/methods.md §4): the wavelet and Haar
filters of a LoRA factor's task core, the update MLP, and `Factor`, the parametrisation that builds
a PEFT factor from the frozen previous one; the public code's 2-D Haar filter and activation MLP."""
import math

import torch
import torch.nn.functional as F
from torch import nn

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
