"""Null-space gradient projection (EoupCT, docs/methods.md §2).

A memory holds directions that past tasks and general knowledge depend on; every new update has
its component inside their span removed. `GradientMemory` keeps an orthonormal basis Q
(Gram–Schmidt applied twice, float64 accumulation) and projects g ← g − Q(Qᵀg); `GramMemory`
keeps raw directions M and projects g ← g − M(MᵀM)⁻¹Mᵀg with a float64 Cholesky of MᵀM formed
once per memory change. Both work on the list of parameter tensors in place (no flattening, no
temporaries of the gradients' size) through the fused `null_space_coeffs` / `null_space_apply_`
ops. `NullSpaceProjector` hooks a memory into an optimizer, projecting either the gradients
before the step or the actual parameter change after it (Adam-NSCL style), so that
Qᵀ(θ_new − θ_old) ≈ 0 also with AdamW and weight decay.

Sharded parameters (DTensor, e.g. FSDP2, also on a 2-D HSDP mesh) are handled by working on the
local shards and all-reducing the Qᵀg partial sums over the mesh dimensions the parameters are
sharded along (never along a Replicate dimension, whose ranks hold the same values); the state
dict of a sharded memory holds the whole directions (gathered from every shard).
"""
import logging
import math
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .ops import (BASIS_DTYPES, SUPPORTED_DTYPES, check_device_arch, null_space_apply_prechecked_,
                  null_space_coeffs_prechecked, taylor_importance)

log = logging.getLogger(__name__)
POLICIES = ("error", "svd")


def _local(t):
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _shard_groups(param) -> Tuple:
    """The process groups over which a parameter's local partial sums add up to the whole sum: one
    per mesh dimension it is sharded along (a Replicate dimension's ranks hold the same values:
    summing over it would count them once per rank); () for a plain tensor. ValueError for a
    Partial placement."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return ()
    if not all(pl.is_shard() or pl.is_replicate() for pl in param.placements):
        raise ValueError(f"parameter placements {param.placements}: only Shard and Replicate are supported")
    return tuple(mesh.get_group(d) for d, pl in enumerate(param.placements) if pl.is_shard())


def _reduction_sets(params, process_group) -> List[Tuple[Optional[List[int]], Tuple]]:
    """[(indices, groups)]: the parameters by the process groups their partial sums are all-reduced
    over (indices None: all of them, the usual case of one engine sharding every parameter alike)."""
    if process_group is not None:
        return [(None, (process_group,))]
    by_groups: Dict[Tuple, List[int]] = {}
    for i, p in enumerate(params):
        by_groups.setdefault(_shard_groups(p), []).append(i)
    if len(by_groups) == 1:
        return [(None, next(iter(by_groups)))]
    return [(index, groups) for groups, index in by_groups.items()]


def _directions_placements(param):
    """The placements of a [k, *shape] stack of directions of a DTensor parameter (Shard dims shifted by one)."""
    from torch.distributed.tensor import Shard

    return [Shard(pl.dim + 1) if pl.is_shard() else pl for pl in param.placements]


def _norm_sq(tensors) -> torch.Tensor:
    """Σ‖t‖² over the list as a float64 0-dim tensor on the device (fused kernel)."""
    return taylor_importance(tensors, tensors)[:, 0].double().sum()


class _Memory:
    """Shared storage: per parameter a [max_directions, *shape] tensor whose first k rows are used."""

    def __init__(self, params: Sequence[torch.nn.Parameter], max_directions: int, dtype=torch.float32,
                 process_group=None):
        params = list(params)
        if not params:
            raise ValueError("no parameters given")
        if max_directions < 1:
            raise ValueError(f"max_directions must be >= 1, got {max_directions}")
        if dtype not in BASIS_DTYPES:
            raise TypeError(f"dtype must be one of {BASIS_DTYPES}, got {dtype}")
        self.params = params
        self.max_directions = max_directions
        self.dtype = dtype
        self._sets = _reduction_sets(params, process_group)
        self.storage = [torch.zeros((max_directions, *_local(p).shape), dtype=dtype, device=_local(p).device)
                        for p in params]
        # What a direction tensor must be, per parameter (read on every call: slicing the storage's
        # shapes each time would cost more than the rest of the check)
        self._direction_specs = [(s.shape[1:], s.device) for s in self.storage]
        for device in {s.device for s in self.storage}:
            check_device_arch(device)  # before any kernel: the fused ops below skip their own checks
        self.k = 0

    @property
    def basis(self) -> List[torch.Tensor]:
        """The views storage[i][:k] (cached per k: slicing hundreds of tensors on every call costs
        more host time than the projection kernels take on a GPU at mid sizes). Do not modify the list."""
        cache = getattr(self, "_basis_cache", None)
        if cache is None or cache[0] != self.k or cache[1] is not self.storage:
            cache = self._basis_cache = (self.k, self.storage, [s[:self.k] for s in self.storage])
        return cache[2]

    def _reduced(self, partial: Callable, tensors) -> torch.Tensor:
        """Σ over the parameters of `partial(basis, tensors)` (a sum over their elements), from
        the local shards: each set of parameters' partial sum all-reduced over its shard groups."""
        total = None
        for index, groups in self._sets:
            t = partial(self.basis, tensors) if index is None else \
                partial([self.basis[i] for i in index], [tensors[i] for i in index])
            for group in groups:
                dist.all_reduce(t, group=group)
            total = t if total is None else total + t
        return total

    def _coeffs(self, tensors) -> torch.Tensor:
        """Qᵀx for a list x that `_check_directions` passed (or that the memory made itself)."""
        return self._reduced(null_space_coeffs_prechecked, tensors)

    def _norm(self, tensors) -> float:
        """‖x‖ of the whole list (all shards)."""
        return math.sqrt(float(self._reduced(lambda basis, ts: _norm_sq(ts).reshape(1), tensors)))

    def projection_coeffs(self, tensors, check_finite: bool = True) -> torch.Tensor:
        """y with proj(x) = Σ_j y_j·basis_j for the list x (float64 [k])."""
        return self._projection_coeffs(self._check_directions(tensors), check_finite)

    def _projection_coeffs(self, tensors, check_finite: bool) -> torch.Tensor:
        c = self._coeffs(tensors)
        if check_finite and not bool(torch.isfinite(c).all()):
            raise FloatingPointError("non-finite gradient: projection not applied")
        return self._solve(c)

    def _solve(self, c: torch.Tensor) -> torch.Tensor:
        return c

    def project_(self, grads, check_finite: bool = True) -> torch.Tensor:
        """x ← x − proj(x) in place over the list (the memory's span removed); returns the
        coefficients y of proj(x). check_finite (one host sync) raises FloatingPointError, before
        anything is written, when the gradients hold NaN/Inf."""
        grads = self._check_directions(grads, in_place=True)
        y = self._projection_coeffs(grads, check_finite)
        if self.k:
            null_space_apply_prechecked_(self.basis, grads, y)
        return y

    def _check_directions(self, direction, in_place: bool = False) -> List[torch.Tensor]:
        """The local tensors of a direction, checked in one pass against the storage (shape,
        device, dtype; contiguous when `in_place`): everything the fused ops need, so that they
        run without checking each tensor again."""
        direction = [_local(t) for t in direction]
        if len(direction) != len(self.params):
            raise ValueError(f"a direction needs {len(self.params)} tensors (one per parameter), got {len(direction)}")
        for i, (t, (shape, device)) in enumerate(zip(direction, self._direction_specs)):
            if not isinstance(t, torch.Tensor) or t.shape != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"direction tensor {i} has shape {got}, expected {tuple(shape)}")
            if t.device != device:
                raise ValueError(f"direction tensor {i} is on {t.device}, expected {device}")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"direction tensor {i} has dtype {t.dtype}; supported: float32, bfloat16, float16")
            if in_place and not t.is_contiguous():
                raise ValueError(f"direction tensor {i} must be contiguous (it is updated in place)")
        return direction

    @staticmethod
    def _as_directions(directions) -> List[List[torch.Tensor]]:
        directions = list(directions)
        if directions and isinstance(directions[0], torch.Tensor):
            return [directions]
        return [list(d) for d in directions]

    def state_dict(self) -> Dict:
        """k, the directions ([k, *parameter shape] per parameter; for sharded parameters gathered
        from every shard, a collective every rank calls) and the memory's own state."""
        storage = [self._full(s[:self.k], p) for s, p in zip(self.storage, self.params)]
        return {"k": self.k, "storage": storage, **self._extra_state()}

    @staticmethod
    def _full(local: torch.Tensor, param) -> torch.Tensor:
        if getattr(param, "device_mesh", None) is None:
            return local.clone()
        from torch.distributed.tensor import DTensor

        placements = _directions_placements(param)
        shape = (local.shape[0], *param.shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, param.device_mesh, placements, shape=shape, stride=stride).full_tensor()

    @staticmethod
    def _shard(full: torch.Tensor, param) -> torch.Tensor:
        """This rank's part of a [k, *parameter shape] stack of whole directions."""
        if getattr(param, "device_mesh", None) is None:
            return full
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, param.device_mesh, _directions_placements(param)).to_local()

    def load_state_dict(self, state: Dict):
        """Restore `state_dict()` (whole directions; every rank of a sharded memory takes its shards)."""
        if len(state["storage"]) != len(self.storage) or state["k"] > self.max_directions:
            raise ValueError("the saved memory belongs to other parameters or a larger max_directions")
        for p, saved in zip(self.params, state["storage"]):
            if saved.shape[1:] != p.shape:
                raise ValueError("the saved memory's tensor shapes differ from the parameters'")
        for s, saved, p in zip(self.storage, state["storage"], self.params):
            s[:state["k"]].copy_(self._shard(saved.to(s.device), p))
        self.k = state["k"]
        self._load_extra_state(state)

    def _extra_state(self) -> Dict:
        return {}

    def _load_extra_state(self, state: Dict):
        pass

    def orthogonality_error(self, grads) -> float:
        """‖Qᵀg‖ / ‖g‖ for the memory's (orthonormalised) span; 0 for an empty memory."""
        grads = self._check_directions(grads)
        if self.k == 0:
            return 0.0
        c = self._coeffs(grads)
        norm = self._norm(grads)
        return float(c.norm()) / norm if norm > 0 else 0.0


class GradientMemory(_Memory):
    """Orthonormal basis Q of protected directions (docs/methods.md §2, robust form).

    `add(directions)` orthogonalises each direction against Q (Gram–Schmidt applied twice,
    float64 coefficients), drops it if its residual norm is below `tol` × its norm (reported in
    the returned dict and logged, never silently), and stores it normalised. A full memory is a
    ValueError unless `policy="svd"`: then the memory keeps the `max_directions` directions of
    largest singular value of [Q·diag(s), r] (s = the residual norm each direction had when it
    was added; since r ⟂ Q that SVD is diagonal, as in GPM's energy criterion).
    `project_(grads)` applies g ← g − Q(Qᵀg) in place. With a float32 basis ‖Qᵀg′‖ ≤ 1e-6·‖g‖
    (measured 2e-8 on 50k elements, k = 16). A bfloat16 basis halves the memory; its rows are
    the float32 Gram–Schmidt result rounded to bfloat16 (2⁻⁹ relative per element), so they are
    orthonormal only approximately: ‖Qᵀg′‖/‖g‖ was 3e-7 on 50k elements and 2e-4 on 76.
    """

    def __init__(self, params, max_directions: int, dtype=torch.float32, tol: float = 1e-4, policy: str = "error",
                 process_group=None):
        super().__init__(params, max_directions, dtype, process_group)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.tol, self.policy = tol, policy
        self.scales: List[float] = []

    def add(self, directions) -> Dict:
        """Add one direction (a list of tensors shaped like the params) or a list of them.
        Returns {"added": [...], "dropped": [...], "replaced": [...], "residual_norms": [...]},
        indices into the given directions. Raises ValueError (memory unchanged) for bad shapes,
        non-finite values, or a full memory with policy="error"."""
        directions = [self._check_directions(d) for d in self._as_directions(directions)]
        for n, d in enumerate(directions):
            if not math.isfinite(float(_norm_sq(d))):
                raise ValueError(f"direction {n} has non-finite values")
        report = {"added": [], "dropped": [], "replaced": [], "residual_norms": []}
        for n, d in enumerate(directions):
            r = [t.detach().float().clone().contiguous() for t in d]
            norm0 = self._norm(r)
            for _ in range(2 if self.k else 0):
                null_space_apply_prechecked_(self.basis, r, self._coeffs(r))
            norm = self._norm(r)
            report["residual_norms"].append(norm)
            if norm0 == 0 or norm <= self.tol * norm0:
                report["dropped"].append(n)
                log.info("GradientMemory: direction %d dropped (residual %.3g of its norm %.3g)", n, norm, norm0)
                continue
            if self.k < self.max_directions:
                slot = self.k
                self.k += 1
                self.scales.append(norm)
            elif self.policy == "svd":
                slot = min(range(self.k), key=lambda j: self.scales[j])
                if self.scales[slot] >= norm:
                    report["dropped"].append(n)
                    log.info("GradientMemory: direction %d compressed out (singular value %.3g)", n, norm)
                    continue
                report["replaced"].append(slot)
                self.scales[slot] = norm
            else:
                raise ValueError(f"GradientMemory is full ({self.max_directions} directions); "
                                 "raise max_directions or use policy='svd'")
            for s, t in zip(self.storage, r):
                s[slot].copy_(t / norm)
            report["added"].append(n)
        return report

    def _extra_state(self):
        return {"scales": list(self.scales)}

    def _load_extra_state(self, state):
        self.scales = list(state["scales"])


class GramMemory(_Memory):
    """Raw directions M with the projection g ← g − M(MᵀM)⁻¹Mᵀg (docs/methods.md §2, Gram form).

    MᵀM is formed once per memory change (not per step) and factorised by a float64 Cholesky
    with a ridge of `ridge` × trace(MᵀM)/k. If M is rank-deficient beyond that ridge (an
    eigenvalue of MᵀM below the ridge) `add` warns, or raises with `strict=True` — the
    projection is never skipped silently.
    """

    def __init__(self, params, max_directions: int, dtype=torch.float32, ridge: float = 1e-6, strict: bool = False,
                 process_group=None):
        super().__init__(params, max_directions, dtype, process_group)
        self.ridge, self.strict = ridge, strict
        self._chol: Optional[torch.Tensor] = None

    def add(self, directions) -> Dict:
        directions = [self._check_directions(d) for d in self._as_directions(directions)]
        if self.k + len(directions) > self.max_directions:
            raise ValueError(f"GramMemory is full ({self.max_directions} directions)")
        for n, d in enumerate(directions):
            if not math.isfinite(float(_norm_sq(d))):
                raise ValueError(f"direction {n} has non-finite values")
        for d in directions:
            for s, t in zip(self.storage, d):
                s[self.k].copy_(t.detach())
            self.k += 1
        self._factorize()
        return {"added": list(range(len(directions))), "k": self.k}

    def _factorize(self):
        basis = self.basis
        gram = torch.stack([self._coeffs([b[j].float().contiguous() for b in basis]) for j in range(self.k)])
        gram = (gram + gram.T) / 2
        ridge = self.ridge * float(gram.diagonal().sum()) / self.k
        smallest = float(torch.linalg.eigvalsh(gram.cpu())[0])
        if smallest < ridge:
            message = (f"GramMemory: the {self.k} directions are rank-deficient beyond the ridge "
                       f"(smallest eigenvalue of MᵀM {smallest:.3g} < ridge {ridge:.3g}); "
                       "the projection uses the ridge")
            if self.strict:
                raise ValueError(message)
            warnings.warn(message)
        self._chol = torch.linalg.cholesky(gram + ridge * torch.eye(self.k, dtype=gram.dtype, device=gram.device))

    def _solve(self, c: torch.Tensor) -> torch.Tensor:
        """(MᵀM + ridge·I)⁻¹ c, so that proj(g) = M(MᵀM + ridge·I)⁻¹Mᵀg."""
        return torch.cholesky_solve(c[:, None], self._chol)[:, 0] if self.k else c

    def _load_extra_state(self, state):
        if self.k:
            self._factorize()


class NullSpaceProjector:
    """Keeps an optimizer's updates out of a memory's span (docs/methods.md §2).

    where="grad": the gradients are projected before `optimizer.step()` (enough for SGD; AdamW's
    per-coordinate scaling and weight decay push the update back out of the null space).
    where="update": θ_old is saved before the step and θ ← θ − proj(θ − θ_old) after it, so the
    applied change satisfies Qᵀ(θ_new − θ_old) ≈ 0 with any optimizer (Adam-NSCL). This costs
    one buffer of the parameters' size. Under DDP the hooks see the all-reduced gradients, so
    every rank applies the same projection.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, memory: _Memory, where: str = "update"):
        if where not in ("grad", "update"):
            raise ValueError(f"where must be 'grad' or 'update', got {where!r}")
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [i for i, p in enumerate(memory.params) if id(p) not in in_optimizer]
        if missing:
            raise ValueError(f"memory parameter {missing[0]} is not optimised by this optimizer")
        self.optimizer, self.memory, self.where = optimizer, memory, where
        self._old: Optional[List[torch.Tensor]] = None
        self._handles = [optimizer.register_step_pre_hook(self._before)]
        if where == "update":
            self._handles.append(optimizer.register_step_post_hook(self._after))

    def _locals(self):
        return [_local(p.data) for p in self.memory.params]

    def _before(self, optimizer, args, kwargs):
        if self.where == "grad":
            grads = [p.grad for p in self.memory.params]
            missing = [i for i, g in enumerate(grads) if g is None]
            if missing:
                raise ValueError(f"parameter {missing[0]} has no gradient: nothing to project")
            self.memory.project_([_local(g) for g in grads])
        elif self.memory.k:
            if self._old is None:
                self._old = [t.detach().clone() for t in self._locals()]
            else:
                torch._foreach_copy_(self._old, self._locals())

    def _after(self, optimizer, args, kwargs):
        if not self.memory.k:
            return
        params = self.memory._check_directions(self._locals(), in_place=True)
        torch._foreach_sub_(self._old, params)  # θ_old − θ_new = −Δ (clones of params: checked too)
        y = self.memory._projection_coeffs(self._old, check_finite=True)  # proj(−Δ) = Σ_j y_j·basis_j
        null_space_apply_prechecked_(self.memory.basis, params, -y)  # θ ← θ + proj(−Δ) = θ − proj(Δ)

    def remove(self):
        for h in self._handles:
            h.remove()
