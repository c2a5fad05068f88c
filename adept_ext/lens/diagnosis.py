"""LayerTracer's diagnostics (docs/methods.md §3, arXiv 2605.11416 §3): where a model integrates task
evidence (logit lens, task particle) and which layers are fragile (layer-wise sensitivity), and
the "train shallow, freeze deep" allocation derived from them.

Layers are indexed like ADEPT's layer importance: i = 0..L-1 is decoder layer i, and a
quantity "at layer i" is measured on that layer's output h_{i+1} (h_0 = the embeddings).

Definitions the paper leaves open, as this module fixes them (all configurable):
- P_t(i) is averaged over the scored positions before Ratio is taken:
  Ratio(i) = (P̄_t(i) − P̄_t(i−1)) / (P̄_t(i−1) + ε), with P̄_t(−1) from the embeddings.
- execution interval: the layers with Ratio(i) > `ratio_threshold` (default 0).
- task particle: the first layer with P̄_t(i) ≥ `threshold` · P̄_t(L−1) (default 0.5: half of
  the final probability of the model's answer t*).
- JS_i = mean over scored positions of JS(P ‖ Q(i)) in nats (≤ ln 2), P the clean and Q(i) the
  final distribution with the context masked at layer i; ΔJS(i) = (JS_i − JS_{i−1}) / (JS_{i−1} + ε)
  for i ≥ 1 (undefined, None, for layer 0).
- allocation (`allocate`, freeze_deep): train the shallow block [0, b) and freeze the rest, with
  b = min(task particle, 1 + the deepest layer with JS_i ≥ `sensitive_fraction` · max JS)
  (default 0.25), clamped to [1, L−1]: the deep block starts where the task evidence is
  integrated or where the layers stop being sensitive to the context, whichever is shallower.
"""
import json
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..models import adapter
from ..adept.probe import LayerScores, device_batch, prefix_shared_variants
from ..report import dataclass_json, plot_diagnosis
from ..errors import InputError

STRATEGIES = ("freeze_deep", "freeze_shallow")
MASKABLE_ATTENTION = ("sdpa", "eager")


@dataclass
class LensProfile:
    """Logit-lens task probability per layer and what is derived from it (see the module docstring)."""

    p_task: List[float]            # P̄_t(i) after decoder layer i
    p_task_embeddings: float       # P̄_t of the embeddings (before layer 0)
    ratio: List[float]             # Ratio(i)
    execution_layers: List[int]    # layers with Ratio(i) > ratio_threshold
    task_particle: int             # first layer with P̄_t(i) >= threshold · P̄_t(L−1)
    threshold: float
    positions: int                 # scored positions
    answer_accuracy: Optional[float] = None  # fraction with t* == answer_ids (when the batches have them)


@dataclass
class SensitivityProfile:
    """JS divergence between the clean and the context-masked-at-layer-i final distributions."""

    js: List[float]                     # JS_i in nats
    delta_js: List[Optional[float]]     # ΔJS(i); None for layer 0
    positions: int


@dataclass
class Diagnosis:
    """The three views of one model: logit lens, sensitivity and (optionally) ADEPT's layer importance."""

    lens: LensProfile
    sensitivity: SensitivityProfile
    importance: Optional[LayerScores] = None

    def to_json(self, path=None) -> str:
        return dataclass_json(self, path)

    @classmethod
    def from_json(cls, path) -> "Diagnosis":
        """A diagnosis written by `to_json` (e.g. to replot it or to allocate from it later)."""
        with open(path) as f:
            d = json.load(f)
        return cls(LensProfile(**d["lens"]), SensitivityProfile(**d["sensitivity"]),
                   LayerScores(**d["importance"]) if d.get("importance") else None)

    def plot(self, path, title: str = "LayerTracer diagnosis"):
        """PNG with P̄_t(i), JS_i / ΔJS(i) and the layer importance on one shared layer axis."""
        plot_diagnosis(path, self.lens.p_task, self.lens.task_particle, self.sensitivity.js, self.sensitivity.delta_js,
                       self.importance.scores if self.importance else None, title,
                       boundary=boundary_from(self))


def _checked(model, batches, need_context: bool):
    ad = adapter(model)
    batches = list(batches)
    if not batches:
        raise InputError("no batches to diagnose")
    for i, batch in enumerate(batches):
        shape = batch["input_ids"].shape
        for key in ("attention_mask", "context_mask", "score_mask"):
            if key in batch and batch[key].shape != shape:
                raise InputError(f"batch {i}: {key} has shape {tuple(batch[key].shape)}, input_ids {tuple(shape)}")
        if need_context and "context_mask" not in batch:
            raise InputError(f"batch {i} has no context_mask (bool [B, T], True on the context s_1)")
    if need_context and getattr(model.config, "_attn_implementation", "eager") not in MASKABLE_ATTENTION:
        raise InputError(f"layer_sensitivity masks attention per layer, which needs attn_implementation in "
                         f"{MASKABLE_ATTENTION}; the model uses {model.config._attn_implementation!r}")
    return ad, batches


def _attended(batch) -> torch.Tensor:
    mask = batch.get("attention_mask")
    return torch.ones_like(batch["input_ids"], dtype=torch.bool) if mask is None else mask.bool()


def _query(batch) -> torch.Tensor:
    return _attended(batch) & ~batch["context_mask"].bool()


def _scored(batch, default) -> torch.Tensor:
    score = batch.get("score_mask")
    return default if score is None else score.bool() & _attended(batch)


def _argmax_rows(rows, weight, chunk_rows):
    """argmax of rows @ weightᵀ, chunk_rows rows at a time (the logits are never all stored)."""
    return torch.cat([(c @ weight.t()).argmax(-1) for c in rows.split(chunk_rows)]) if rows.shape[0] else \
        torch.zeros(0, dtype=torch.long, device=rows.device)


@torch.no_grad()
def logit_lens(model, batches: Iterable[Dict[str, torch.Tensor]], threshold: float = 0.5,
               ratio_threshold: float = 0.0, eps: float = 1e-6, chunk_rows: int = 256,
               progress: bool = True) -> LensProfile:
    """Logit lens (docs/methods.md §3): P(i) = softmax(W_U · norm(h_{i+1})) for every decoder layer i, with
    t* = argmax of the final distribution and P_t(i) = P(i)[t*] at the scored positions
    (batch["score_mask"], else every attended position). Every layer's output is captured
    before the final norm and normed once, so the last layer's P equals the model's output
    distribution. P_t comes from the fused `linear_cross_entropy` (P_t = exp(−CE(t*)); with the
    head's logit scale, and chunked capped logits for a soft-capped head), so no L × T × V tensor
    is stored. Batches: dicts with input_ids, optionally attention_mask,
    score_mask and answer_ids ([B], then `answer_accuracy` is reported). Raises ValueError for
    empty batches or no scored position; the model is left as it was.
    """
    if not 0 < threshold <= 1:
        raise InputError(f"threshold must be in (0, 1], got {threshold}")
    ad, batches = _checked(model, batches, need_context=False)
    device = ad.lm_head.weight.device
    weight = ad.lm_head.weight
    sums = torch.zeros(ad.num_layers + 1, dtype=torch.float64, device=device)
    positions, correct, answered = 0, 0, 0
    was_training = model.training
    model.eval()
    try:
        for batch in tqdm(batches, desc="logit lens", disable=not progress):
            batch = device_batch(batch, device)
            score = _scored(batch, _attended(batch))
            states = []
            hooks = [ad.layers[0].register_forward_pre_hook(
                lambda m, args, kwargs: states.append((args[0] if args else kwargs["hidden_states"])[score]),
                with_kwargs=True)]
            hooks += [layer.register_forward_hook(lambda m, a, out: states.append((out[0] if isinstance(out, tuple)
                                                                                   else out)[score]))
                      for layer in ad.layers]
            try:
                ad.decoder(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
            finally:
                for h in hooks:
                    h.remove()
            rows = ad.final_norm(torch.stack(states))  # [L+1, R, H]
            n = rows.shape[1]
            target = _argmax_rows(rows[-1], weight, chunk_rows)
            ce = ad.head_losses(rows.reshape(-1, rows.shape[-1]), target.repeat(len(states)))
            sums += torch.exp(-ce.double()).view(len(states), n).sum(1)
            positions += n
            if "answer_ids" in batch and n == batch["input_ids"].shape[0]:  # one scored position per row
                correct += int((target == batch["answer_ids"]).sum())
                answered += n
    finally:
        model.train(was_training)
    if positions == 0:
        raise InputError("no scored position in the batches (score_mask / attention_mask are all False)")
    means = (sums / positions).tolist()
    embeddings, p_task = means[0], means[1:]
    before = [embeddings] + p_task[:-1]
    ratio = [(p - q) / (q + eps) for p, q in zip(p_task, before)]
    particle = next(i for i, p in enumerate(p_task) if p >= threshold * p_task[-1])
    return LensProfile(p_task, embeddings, ratio, [i for i, r in enumerate(ratio) if r > ratio_threshold], particle,
                       threshold, positions, correct / answered if answered else None)


def context_masked(mask: Optional[torch.Tensor], context: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A decoder layer's attention mask with the query rows' attention to the context blocked:
    `mask` as the model passes it to the layer ([B, 1, T, T] bool for sdpa, additive float for
    eager, or None for sdpa's implicit causal mask)."""
    blocked = query[:, None, :, None] & context[:, None, None, :]
    if mask is None:
        t = context.shape[1]
        return torch.ones(t, t, dtype=torch.bool, device=context.device).tril() & ~blocked
    if mask.dtype == torch.bool:
        return mask & ~blocked
    return mask.masked_fill(blocked, torch.finfo(mask.dtype).min)


def js_divergence_sum(hidden_p: torch.Tensor, hidden_q: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor],
                      chunk_rows: int = 64) -> torch.Tensor:
    """Σ over rows of JS(softmax(logits(h_p)) ‖ softmax(logits(h_q))) in nats, `chunk_rows` rows at
    a time (never all logits at once), in float64 (JS of close distributions cancels badly in
    float32). `logits`: the model's head (`ModelAdapter.head_logits`: with Granite's scale and
    Gemma 2's soft-capping)."""
    total = torch.zeros((), dtype=torch.float64, device=hidden_p.device)
    for hp, hq in zip(hidden_p.split(chunk_rows), hidden_q.split(chunk_rows)):
        lp, lq = logits(hp).double().log_softmax(-1), logits(hq).double().log_softmax(-1)
        lm = torch.logaddexp(lp, lq) - math.log(2)
        total += 0.5 * ((lp.exp() * (lp - lm)).sum() + (lq.exp() * (lq - lm)).sum())
    return total


@torch.no_grad()
def layer_sensitivity(model, batches: Iterable[Dict[str, torch.Tensor]],
                      context_mask: Optional[Sequence[torch.Tensor]] = None, eps: float = 1e-6,
                      chunk_rows: int = 64, max_tokens_per_call: int = 1024,
                      progress: bool = True) -> SensitivityProfile:
    """Layer-wise sensitivity (docs/methods.md §3): inputs are composite, context s_1 ⊕ query s_2
    (`context_mask[i]`, else batch["context_mask"]: bool [B, T], True on s_1). Perturbation at
    layer i: in that layer only, the query positions cannot attend to the context. JS_i =
    JS(P, Q(i)) between the clean and the perturbed final distributions at the scored query
    positions (batch["score_mask"] & query, else every query position), and ΔJS(i) its relative
    change from layer i−1. The variant "perturbed at i" shares h_0..h_i with the clean run
    (Stage 1's prefix-shared engine, `probe.prefix_shared_variants`): L(L+1)/2 layer calls
    instead of L², and only the scored rows are projected to the vocabulary. Memory: the L
    variant streams [L, B, T, H] plus one layer call of at most `max_tokens_per_call` tokens
    (smaller than the probe's default: here the peak should stay below one naive forward). Needs
    attn_implementation sdpa or eager. Raises ValueError for empty batches, a missing or
    misshaped context mask, no context or no scored query position; the model is left as it was.
    """
    if context_mask is not None:
        batches = [{**b, "context_mask": m} for b, m in zip(batches, context_mask, strict=True)]
    ad, batches = _checked(model, batches, need_context=True)
    if not any(b["context_mask"].bool().any() for b in batches):
        raise InputError("context_mask marks no token: there is no context s_1 to mask")
    device = ad.lm_head.weight.device
    sums = torch.zeros(ad.num_layers, dtype=torch.float64, device=device)
    positions = 0
    was_training = model.training
    model.eval()
    # Two ticks per layer and batch (the masked variant's depth, then its JS): a batch takes minutes on a CPU.
    bar = tqdm(total=2 * ad.num_layers * len(batches), desc=f"layer sensitivity ({len(batches)} batches x "
               f"{ad.num_layers} layers)", disable=not progress)
    try:
        for batch in batches:
            batch = device_batch(batch, device)
            context, query = batch["context_mask"].bool() & _attended(batch), _query(batch)
            score = _scored(batch, query) & query
            if not score.any():
                bar.update(2 * ad.num_layers)
                continue

            def masked_layer(layer, hidden, args, kwargs):
                out = layer(hidden, *args, **{**kwargs, "attention_mask": context_masked(
                    kwargs.get("attention_mask"), context, query)})
                return out[0] if isinstance(out, tuple) else out

            clean, variants = prefix_shared_variants(ad, batch, masked_layer, max_tokens_per_call,
                                                     on_layer=lambda d: bar.update(1))
            clean_rows = clean[score]
            for i in range(ad.num_layers):
                sums[i] += js_divergence_sum(clean_rows, ad.final_norm(variants[i][score]), ad.head_logits,
                                             chunk_rows)
                bar.update(1)
            positions += int(score.sum())
    finally:
        bar.close()
        model.train(was_training)
    if positions == 0:
        raise InputError("no scored query position (score_mask & ~context_mask & attention_mask are all False)")
    js = (sums / positions).tolist()
    delta = [None] + [(j - i) / (i + eps) for i, j in zip(js, js[1:])]
    return SensitivityProfile(js, delta, positions)


def diagnose(model, batches, importance: Optional[LayerScores] = None, threshold: float = 0.5,
             progress: bool = True, **kwargs) -> Diagnosis:
    """Both diagnostics on the same composite batches (see `logit_lens`, `layer_sensitivity`),
    with ADEPT's layer importance attached for comparison when given."""
    batches = list(batches)
    return Diagnosis(logit_lens(model, batches, threshold=threshold, progress=progress),
                     layer_sensitivity(model, batches, progress=progress, **kwargs), importance)


def boundary_from(diagnosis: Diagnosis, sensitive_fraction: float = 0.25) -> int:
    """The freeze_deep boundary b of `diagnosis` (rule in the module docstring), clamped to [1, L−1]."""
    js = diagnosis.sensitivity.js
    n = len(js)
    last_sensitive = max(i for i, j in enumerate(js) if j >= sensitive_fraction * max(js))
    return min(max(min(diagnosis.lens.task_particle, last_sensitive + 1), 1), n - 1)


def allocate(model_or_layers, strategy: str = "freeze_deep", diagnosis: Optional[Diagnosis] = None,
             boundary: Optional[int] = None, sensitive_fraction: float = 0.25) -> List[int]:
    """The trainable layers under LayerTracer's allocation (docs/methods.md §3): `freeze_deep` trains the
    shallow block [0, b), `freeze_shallow` (the paper's reverse arm) the deep block [b, L). The
    boundary b is `boundary` if given, else `boundary_from(diagnosis, sensitive_fraction)`, else
    L // 2. `model_or_layers`: a model or its number of decoder layers. Raises ValueError for an
    unknown strategy, a model with fewer than 2 layers or a boundary outside [1, L−1]."""
    n = model_or_layers if isinstance(model_or_layers, int) else adapter(model_or_layers).num_layers
    if strategy not in STRATEGIES:
        raise InputError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    if n < 2:
        raise InputError(f"allocation needs at least 2 layers, the model has {n}")
    if boundary is None:
        boundary = boundary_from(diagnosis, sensitive_fraction) if diagnosis is not None else n // 2
    if not 1 <= boundary <= n - 1:
        raise InputError(f"boundary {boundary} is not in [1, {n - 1}] for a model with {n} layers")
    return list(range(boundary)) if strategy == "freeze_deep" else list(range(boundary, n))
