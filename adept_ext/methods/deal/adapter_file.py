"""The adapter of DEAL's public_code variant between tasks (docs/methods.md §4): forward hooks
h = W₀x + s·B·MLP(Ã x) on the plain model (`PublicCodeAdapter`), written beside a saved model's
weights as `deal_adapter.safetensors` by its `save_pretrained` and put back by `load_adapter`."""
import copy
import types
from pathlib import Path
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InputError
from .filters import ActivationMLP

ADAPTER_FILE = "deal_adapter.safetensors"  # deal_variant public_code: the task's adapter (not mergeable)
ADAPTER_ATTR = "deal_adapter"  # the PublicCodeAdapter a model carries (a plain attribute, not a submodule)


def mlp_on_output(mlp):
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
