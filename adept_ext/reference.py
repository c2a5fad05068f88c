"""Plain-PyTorch definitions of every adept_ext op: the specification the kernels are tested against.

Each function computes in float64, so tests can measure the error of a kernel and of plain
PyTorch in low precision against the same exact-ish result.
"""
from typing import Sequence

import torch


def taylor_importance(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """First-order Taylor importance sums per tensor (docs/methods.md §1.3), float64 [n, 2]:
    column 0 = Σ_j θ_j·g_j, column 1 = Σ_j |θ_j·g_j|."""
    rows = []
    for p, g in zip(params, grads):
        x = p.detach().double() * g.detach().double()
        rows.append(torch.stack([x.sum(), x.abs().sum()]))
    if not rows:
        return torch.zeros(0, 2, dtype=torch.float64)
    return torch.stack(rows)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Per-row cross-entropy of hidden @ weight.T against targets (0 at ignored rows), float64 [N]
    (docs/methods.md §1.1: the loss of every probe variant). Differentiable: autograd through it in float64
    is the reference of the op's backward."""
    logits = hidden.double() @ weight.double().T
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")


def linear_cross_entropy_logsumexp(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """The op's second output: float64 [N] logsumexp of each row's logits, 0 at ignored rows."""
    lse = torch.logsumexp(hidden.double() @ weight.double().T, dim=1)
    return lse.masked_fill(targets == ignore_index, 0)


def linear_cross_entropy_grad_logits(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                                     grad_loss: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The backward's per-chunk step (docs/methods.md §1.1): float64 [c, V]
    d = g_r·(exp(z − lse_r) − onehot(t_r)), 0 at ignored rows (in place on z in the kernel)."""
    ignored = targets == ignore_index
    d = torch.exp(logits.double() - lse.double()[:, None])
    rows = torch.arange(len(targets), device=logits.device)[~ignored]
    d[rows, targets[~ignored]] -= 1
    return (d * grad_loss.double()[:, None]).masked_fill(ignored[:, None], 0)


@torch.no_grad()
def bypass_layer_losses(model, batches):
    """Naive definition of ADEPT's probe (docs/methods.md §1.1): L+1 full forwards of the HF model with
    labels, one layer bypassed at a time by a forward hook that returns the layer's input.
    Returns (base loss, [loss with layer l bypassed]), each token-weighted over the batches."""
    layers = model.model.layers

    def mean_loss(skip):
        hook = None
        if skip is not None:
            hook = layers[skip].register_forward_hook(
                lambda m, args, kwargs, out: args[0] if args else kwargs["hidden_states"], with_kwargs=True)
        try:
            total, count = 0.0, 0
            for batch in batches:
                n = int((batch["labels"][:, 1:] != -100).sum())
                total += float(model(**batch, use_cache=False).loss.double()) * n
                count += n
            return total / count
        finally:
            if hook is not None:
                hook.remove()

    return mean_loss(None), [mean_loss(l) for l in range(len(layers))]


def head_logits(model, hidden):
    """The logits a Hugging Face causal LM gives final-norm outputs: lm_head, then Granite's
    division by `logits_scaling` and Gemma 2's soft-capping c·tanh(z / c), as their forwards do."""
    logits = model.lm_head(hidden) / getattr(model.config, "logits_scaling", 1.0)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


@torch.no_grad()
def logit_lens_task_probs(model, batch, score_mask):
    """Naive logit lens (docs/methods.md §3) on one batch: HF hidden states, the final norm on every entry
    but the last (Hugging Face's last entry is already normed), full softmax over the vocabulary.
    Returns the task probabilities P(i)[t*] at the scored positions, float64 [L+1, R]
    (embeddings first), t* = argmax of the model's output distribution."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), output_hidden_states=True,
                use_cache=False)
    target = out.logits[score_mask].argmax(-1, keepdim=True)
    last = len(out.hidden_states) - 1
    return torch.stack([head_logits(model, h if i == last else model.model.norm(h))[score_mask].double().softmax(-1)
                        .gather(1, target).squeeze(1) for i, h in enumerate(out.hidden_states)])


@torch.no_grad()
def context_masked_js(model, batch, context_mask, score_mask):
    """Naive layer-wise sensitivity (docs/methods.md §3) on one batch: one full forward per layer l in which
    a pre-hook rebuilds layer l's attention mask so that query positions (attended, not context)
    cannot see context positions. Returns JS(P, Q(l)) in nats at the scored positions, float64
    [L, R] (L+1 forwards, full logits)."""
    layers = model.model.layers
    attended = batch["attention_mask"].bool()
    blocked = (attended & ~context_mask)[:, None, :, None] & context_mask[:, None, None, :]

    def forward():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     use_cache=False).logits[score_mask].double().softmax(-1)

    def block_context(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        t = batch["input_ids"].shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool, device=blocked.device).tril() if mask is None else \
            (mask if mask.dtype == torch.bool else mask == 0)
        allowed = allowed & ~blocked
        kwargs["attention_mask"] = allowed if mask is None or mask.dtype == torch.bool else \
            torch.zeros_like(mask).masked_fill(~allowed, torch.finfo(mask.dtype).min)
        return args, kwargs

    p = forward()
    rows = []
    for layer in layers:
        handle = layer.register_forward_pre_hook(block_context, with_kwargs=True)
        try:
            q = forward()
        finally:
            handle.remove()
        m = (p + q) / 2
        rows.append(0.5 * (torch.xlogy(p, p / m).sum(-1) + torch.xlogy(q, q / m).sum(-1)))
    return torch.stack(rows)


def null_space_coeffs(basis, grads) -> torch.Tensor:
    """c = Qᵀg (docs/methods.md §2): basis[i] is [k, *grads[i].shape]; float64 [k]."""
    k = basis[0].shape[0]
    c = torch.zeros(k, dtype=torch.float64)
    for q, g in zip(basis, grads):
        c += q.detach().double().reshape(k, g.numel()).cpu() @ g.detach().double().reshape(-1).cpu()
    return c


def null_space_project(basis, grads, coeffs=None):
    """g − Q c for every tensor, float64 copies (docs/methods.md §2); c = Qᵀg unless given."""
    c = null_space_coeffs(basis, grads) if coeffs is None else coeffs.double().cpu()
    k = basis[0].shape[0]
    return [g.detach().double().cpu() - (c @ q.detach().double().cpu().reshape(k, g.numel())).reshape(g.shape)
            for q, g in zip(basis, grads)]


def conflict_correct(g_new, g_pre, lam: float, eps: float):
    """docs/methods.md §2 conflict correction on float64 copies: if <g_new, g_pre> < −eps·|g_new|·|g_pre|,
    g_new ← g_new − (<g_new, g_pre>/|g_pre|²)·g_pre; then g_new + lam·g_pre."""
    a = [t.detach().double().cpu() for t in g_new]
    b = [t.detach().double().cpu() for t in g_pre]
    dot = sum(float((x * y).sum()) for x, y in zip(a, b))
    pp = sum(float((y * y).sum()) for y in b)
    nn = sum(float((x * x).sum()) for x in a)
    coef = dot / pp if pp > 0 and dot < -eps * (pp * nn) ** 0.5 else 0.0
    return [x + (lam - coef) * y for x, y in zip(a, b)], coef
