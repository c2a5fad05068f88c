"""ADEPT Stage 1: layer importance on a general-domain probe corpus (docs/methods.md §1.1).

I_layer(l) = L̂(l) − L_base, the increase of the mean next-token loss when layer l is bypassed
(h_{l+1} = h_l). `method="bypass"` computes it exactly for all layers at once: the variant
"bypass l" shares h_0..h_l with the base run, so the L variants take L(L+1)/2 layer calls
(the streams alive at each depth are batched into one call), and every variant's loss comes
from the fused `linear_cross_entropy` op, so the L×T×V logits are never stored. Cheap
estimates with the same interface: `block_influence` (ShortGPT: 1 − cos(h_l, h_{l+1})) and
`taylor` (first order: −⟨f_l(h_l), ∂L/∂h_{l+1}⟩). Weights and .grad are never modified.
"""
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .. import parallel
from ..models import adapter
from ..report import dataclass_json, plot_layer_scores

METHODS = ("bypass", "block_influence", "taylor")
# Default max_tokens_per_call by device type: on a GPU larger layer calls cut the L(L+1)/2 calls'
# launch and Python overhead (e.g. 2 variant streams of 8×512 per call) at a few hundred MB more.
DEFAULT_MAX_TOKENS_PER_CALL = {"cpu": 4096, "cuda": 8192}


@dataclass
class LayerScores:
    """Per-layer scores; for `bypass` the raw Δloss (higher = more critical to general ability).
    `selected`: the layers chosen from these scores (e.g. for expansion), when recorded."""

    method: str
    scores: List[float]
    tokens: int
    base_loss: Optional[float] = None
    variant_losses: Optional[List[float]] = None
    extra: Dict = field(default_factory=dict)
    selected: Optional[List[int]] = None

    def select(self, k: int) -> List[int]:
        """The k least important layers (lowest scores; ties by index), ascending."""
        if not isinstance(k, int) or k < 0 or k > len(self.scores):
            raise ValueError(f"k must be an int in [0, {len(self.scores)}], got {k!r}")
        return sorted(sorted(range(len(self.scores)), key=lambda i: (self.scores[i], i))[:k])

    def to_json(self, path=None, selected: Optional[Iterable[int]] = None) -> str:
        """The scores as JSON (also written to `path` when given); `selected` (e.g. `select(k)`)
        is recorded as "selected" (the scores keep it)."""
        if selected is not None:
            self.selected = self._checked_layers(selected)
        return dataclass_json(self, path)

    def plot(self, path, title: Optional[str] = None, highlight: Optional[Iterable[int]] = None,
             label: str = "selected"):
        """Bar chart of the scores as a PNG; `highlight` (default: `selected`) in orange, named
        `label` in the legend."""
        ylabel = "Δ loss when bypassed" if self.method == "bypass" else f"{self.method} score"
        chosen = self._checked_layers(highlight if highlight is not None else self.selected or [])
        plot_layer_scores(self.scores, path, ylabel, title or f"layer importance ({self.method}, {self.tokens} tokens)",
                          chosen, label)

    def _checked_layers(self, layers: Iterable[int]) -> List[int]:
        layers = sorted({int(l) for l in layers})
        if layers and not 0 <= layers[0] <= layers[-1] < len(self.scores):
            raise ValueError(f"selected layers {layers} are not all in [0, {len(self.scores) - 1}]")
        return layers


def _shifted_targets(batch) -> torch.Tensor:
    """Next-token targets [B, T]: labels shifted left by one, -100 at the last position."""
    labels = batch.get("labels")
    if labels is None:
        mask = batch.get("attention_mask")
        labels = batch["input_ids"] if mask is None else batch["input_ids"].masked_fill(mask == 0, -100)
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _repeat_batch(value, batch_size: int, times: int):
    """Repeat every tensor (also inside tuples) whose first dimension is the batch."""
    if isinstance(value, torch.Tensor):
        if value.dim() and value.shape[0] == batch_size > 1:
            return value.repeat(times, *[1] * (value.dim() - 1))
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_repeat_batch(v, batch_size, times) for v in value)
    if isinstance(value, dict):
        return {k: _repeat_batch(v, batch_size, times) for k, v in value.items()}
    return value


@contextmanager
def _capture_layer_inputs(layers):
    """Records (hidden_states, other kwargs) of every decoder-layer call, in order."""
    calls = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        calls.append((hidden, args[1:], rest))

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _gathered_for_probe(model, layers):
    """FSDP2 (`fully_shard`): inside, the root's own parameters (embeddings, final norm, lm_head)
    are gathered, and each decoder layer's stay gathered from its call until the next layer's
    (so the variant streams' extra calls of a layer inside its pre-hook use the same gathered
    weights and issue no collective of their own); every rank makes the same all-gathers per
    batch. Nothing for an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [layer for layer in layers if isinstance(layer, FSDPModule)]
    if not isinstance(model, FSDPModule):
        if sharded:
            raise ValueError("the decoder layers are sharded (fully_shard) but the model is not: shard the root "
                             "module too (as adept_ext.parallel.fully_shard_model does)")
        yield
        return
    handles = [layer.register_forward_pre_hook(lambda module, args, previous=previous: previous.reshard())
               for previous, layer in zip(sharded, sharded[1:])]
    for layer in sharded:
        layer.set_reshard_after_forward(False, recurse=False)
    model._get_fsdp_state()._lazy_init()  # as the root's own forward would: else the first layer called claims root
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
        for layer in sharded:
            layer.set_reshard_after_forward(True, recurse=False)
            layer.reshard()
        for handle in handles:
            handle.remove()


def _padded_rank_share(batches: List, sharded: bool) -> List:
    """This rank's probe batches, batches[rank::world]; on a sharded model padded with zero-weight
    runs (None: run the first batch, count nothing) up to the largest share, so that
    every rank makes the same sequence of collective-bearing layer calls."""
    share = list(batches[dist.get_rank()::dist.get_world_size()])
    if not sharded:
        return share
    return share + [None] * (-(-len(batches) // dist.get_world_size()) - len(share))


def device_batch(batch, device):
    """Every tensor of a batch dict on `device`."""
    return {k: v.to(device) for k, v in batch.items()}


def _variant_group(batch, max_tokens_per_call: int) -> int:
    """How many variant streams of `batch` go through one layer call (or one loss call) together."""
    b, t = batch["input_ids"].shape
    return max(1, max_tokens_per_call // (b * t))


@torch.no_grad()
def prefix_shared_variants(ad, batch, start: Callable, max_tokens_per_call: int = 4096,
                           on_layer: Optional[Callable[[int], None]] = None):
    """Run the model once on `batch` together with one variant stream per decoder layer, where
    variant d equals the base run up to layer d's input h_d, leaves layer d as
    `start(layer, h_d, args, kwargs)` instead of layer(h_d, ...), and then goes through the
    layers d+1.. like the base run. Returns (base last hidden state after the final norm
    [B, T, H], variants' last-layer outputs before the final norm [L, B, T, H]).

    The variants share the base run's prefix, so they take L(L+1)/2 layer calls instead of L².
    When the base run reaches layer d (a forward pre-hook, which also gives that layer's exact
    mask and rotary arguments), variants 0..d-1 go through layer d together, in groups of at
    most `max_tokens_per_call` tokens (at least one batch), and variant d starts; then
    `on_layer(d)` is called (e.g. to tick a progress bar once per depth).
    """
    layers = ad.layers
    n_layers = len(layers)
    b, t = batch["input_ids"].shape
    group = _variant_group(batch, max_tokens_per_call)
    buf = None
    inside = False

    def advance_variants(d, layer, args, kwargs):
        nonlocal buf, inside
        if inside:  # our own call of the layer below
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        rest_args, rest = args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"}
        if buf is None:
            buf = hidden.new_empty((n_layers, *hidden.shape))
        inside = True
        try:
            for g0 in range(0, d, group):
                g = min(group, d - g0)
                out = layer(buf[g0:g0 + g].flatten(0, 1), *_repeat_batch(rest_args, b, g), **_repeat_batch(rest, b, g))
                buf[g0:g0 + g] = out.view(g, *hidden.shape)
            buf[d] = start(layer, hidden, rest_args, rest)
        finally:
            inside = False
        if on_layer is not None:
            on_layer(d)
        return None

    handles = [layer.register_forward_pre_hook(partial(advance_variants, d), with_kwargs=True)
               for d, layer in enumerate(layers)]
    try:
        base_out = ad.decoder(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                              use_cache=False).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    return base_out, buf


def _ticks_per_batch(method: str, n_layers: int, batch, max_tokens_per_call: int) -> int:
    """Progress ticks of one probe batch: one per layer, plus one per group of bypass variants scored."""
    if method != "bypass":
        return n_layers
    return n_layers + -(-n_layers // _variant_group(batch, max_tokens_per_call))


@torch.no_grad()
def _bypass_sums(ad, batch, chunk_rows, max_tokens_per_call, tick):
    """Loss sums of the base model and of each bypass variant ("bypass d": h_{d+1} = h_d) on one
    batch: float64 [L+1]. `tick(n)` is called once per layer depth and once per group of
    variants whose loss is computed (`_ticks_per_batch`)."""
    b, t = batch["input_ids"].shape
    group = _variant_group(batch, max_tokens_per_call)
    base_out, buf = prefix_shared_variants(ad, batch, lambda layer, hidden, args, kwargs: hidden, max_tokens_per_call,
                                           on_layer=lambda d: tick(1))
    n_layers = buf.shape[0]
    h = base_out.shape[-1]

    targets = _shifted_targets(batch).reshape(-1)
    valid = (targets != -100).nonzero().squeeze(1)
    def loss_sums(final_hidden):  # [g, B, T, H] after the final norm -> [g]
        g = final_hidden.shape[0]
        rows = final_hidden.reshape(g, b * t, h)[:, valid].reshape(-1, h)
        losses = ad.head_losses(rows, targets[valid].repeat(g), chunk_rows=chunk_rows)
        return losses.view(g, -1).double().sum(1)

    sums = [loss_sums(base_out[None])]
    for g0 in range(0, n_layers, group):
        sums.append(loss_sums(ad.final_norm(buf[g0:g0 + group])))
        tick(1)
    return torch.cat(sums), valid.numel()


@torch.no_grad()
def _block_influence_sums(ad, batch, chunk_rows, max_tokens_per_call, tick):
    """Σ over scored tokens of 1 − cos(h_l, h_{l+1}) per layer: float64 [L]; `tick(1)` per layer."""
    outputs = []

    def record(module, args, out):
        outputs.append(out[0] if isinstance(out, tuple) else out)
        tick(1)

    handles = [layer.register_forward_hook(record) for layer in ad.layers]
    try:
        with _capture_layer_inputs(ad.layers) as calls:
            ad.decoder(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    scored = _shifted_targets(batch) != -100
    sums = [(1 - torch.nn.functional.cosine_similarity(calls[l][0], outputs[l], dim=-1))[scored].double().sum()
            for l in range(len(ad.layers))]
    return torch.stack(sums), int(scored.sum())


def _taylor_sums(ad, batch, chunk_rows, max_tokens_per_call, tick):
    """First-order bypass effect per layer, Σ over scored tokens of −⟨f_l(h_l), ∂ℓ/∂h_{l+1}⟩: float64 [L];
    `tick(1)` per layer of the forward pass."""
    ins, outs = [], []

    def record(module, args, kwargs, out):
        ins.append(args[0] if args else kwargs["hidden_states"])
        outs.append(out[0] if isinstance(out, tuple) else out)
        tick(1)

    handles = [layer.register_forward_hook(record, with_kwargs=True) for layer in ad.layers]
    try:
        with torch.enable_grad():
            embeds = ad.embed_tokens(batch["input_ids"]).detach().requires_grad_(True)
            hidden = ad.decoder(inputs_embeds=embeds, attention_mask=batch.get("attention_mask"),
                                use_cache=False).last_hidden_state
            targets = _shifted_targets(batch).reshape(-1)
            logits = ad.head_logits(hidden).reshape(-1, ad.lm_head.weight.shape[0]).float()
            loss_sum = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
            grads = torch.autograd.grad(loss_sum, outs)
    finally:
        for h in handles:
            h.remove()
    sums = [-((o - i).detach().double() * g.double()).sum() for i, o, g in zip(ins, outs, grads)]
    return torch.stack(sums), int((targets != -100).sum())


def layer_importance(model, batches: Iterable[Dict[str, torch.Tensor]], method: str = "bypass",
                     chunk_rows: Optional[int] = None, max_tokens_per_call: Optional[int] = None,
                     progress: bool = True) -> LayerScores:
    """Score every decoder layer of `model` on probe `batches` (dicts with input_ids and optionally
    attention_mask and labels; -100 labels are not scored).

    bypass: exact Δloss per layer (docs/methods.md §1.1); block_influence: mean 1 − cos(h_l, h_{l+1});
    taylor: first-order estimate of the Δloss. `max_tokens_per_call` bounds the tokens of the
    variant streams that go through one layer call together (memory vs. batching: at least
    one batch's worth; default by the device, `DEFAULT_MAX_TOKENS_PER_CALL`); `chunk_rows` is passed to
    `linear_cross_entropy`. Under an initialised torch.distributed process
    group each rank probes batches[rank::world_size] and the sums are all-reduced, so every rank
    returns the same scores. Raises ValueError for an unknown method, an unsupported model or
    probe data with no token to score. The model is left exactly as it was (weights, .grad and
    train/eval mode).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if max_tokens_per_call is not None and (not isinstance(max_tokens_per_call, int) or max_tokens_per_call < 1):
        raise ValueError(f"max_tokens_per_call must be a positive int, got {max_tokens_per_call!r}")
    ad = adapter(model)
    batches = list(batches)
    if not batches:
        raise ValueError("probe data is empty: no batches")
    distributed = dist.is_available() and dist.is_initialized()
    sharded = distributed and parallel.is_sharded(model)
    if sharded and method == "taylor":
        raise ValueError("the taylor probe needs gradients through an unsharded model: probe before fully_shard, "
                         "or use bypass or block_influence")
    filler = batches[0]  # what a zero-weight pad (None) runs
    if distributed:
        batches = _padded_rank_share(batches, sharded)
    device = ad.lm_head.weight.device
    if max_tokens_per_call is None:
        max_tokens_per_call = DEFAULT_MAX_TOKENS_PER_CALL.get(device.type, 4096)
    per_batch = {"bypass": _bypass_sums, "block_influence": _block_influence_sums, "taylor": _taylor_sums}[method]
    was_training = model.training
    model.eval()
    n_out = ad.num_layers + 1 if method == "bypass" else ad.num_layers
    sums = torch.zeros(n_out, dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    # One tick per layer depth (and, for bypass, per group of variants scored), not per batch:
    # a batch of the default probe takes tens of seconds on a CPU.
    total = sum(_ticks_per_batch(method, ad.num_layers, batch or filler, max_tokens_per_call) for batch in batches)
    bar = tqdm(total=total, desc=f"probing layers ({method}, {len(batches)} batches x {ad.num_layers} layers)",
               disable=not progress)
    try:
        with _gathered_for_probe(model, ad.layers):
            for batch in batches:
                s, n = per_batch(ad, device_batch(batch or filler, device), chunk_rows, max_tokens_per_call,
                                 bar.update)
                if batch is not None:
                    sums += s
                    tokens += n
    finally:
        bar.close()
        model.train(was_training)
    if distributed:
        packed = torch.cat([sums, tokens.view(1)])
        dist.all_reduce(packed)
        sums, tokens = packed[:-1], packed[-1]
    total = int(tokens.item())
    if total == 0:
        raise ValueError("probe data has no token to score (all labels are -100 or blocks are too short)")
    means = (sums / total).tolist()
    if method == "bypass":
        base, variants = means[0], means[1:]
        return LayerScores(method, [v - base for v in variants], total, base_loss=base, variant_losses=variants)
    return LayerScores(method, means, total)
