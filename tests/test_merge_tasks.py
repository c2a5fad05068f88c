"""merge_tasks (methods/merge_tasks.py): the merged weights against PEFT's merge functions applied to the
tasks' ΔW as PEFT's own adapters compute them (get_delta_weight), and each task trained from the base."""
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from tiny_models import tiny_model

from adept_ext.methods import Context, MergeTasksConfig, get_method
from adept_ext.methods.lora import target_modules


def trained_task(method, model, task_index, seed):
    """Prepare the task, give its adapter random factors (as trained), return the PEFT state to reuse."""
    from peft import get_peft_model_state_dict

    method.prepare(model, Context(general_probe=[], task_index=task_index, seed=0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in method.peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return {k: v.clone() for k, v in get_peft_model_state_dict(method.peft_model).items()}


@pytest.mark.parametrize("combination", ["ties", "task_arithmetic"])
def test_the_merge_is_peft_merge_of_the_tasks_delta_weights(combination):
    from peft.utils import merge_utils

    base = tiny_model("llama")
    reference = copy.deepcopy(base)
    method = get_method(MergeTasksConfig(rank=2, combination=combination, density=0.5, weight=0.8))
    states = []
    model = base
    for t in range(2):
        states.append(trained_task(method, model, t, seed=t))
        if t == 1:  # the second task starts from the base, not from the first task's merge
            assert all(torch.equal(layer.base_layer.weight, reference.get_submodule(name.removeprefix(
                "base_model.model.")).weight) for name, layer in method.peft_model.named_modules()
                if hasattr(layer, "base_layer") and hasattr(layer, "lora_A"))
        model = method.end_task(method.peft_model, None, {})
    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=target_modules(reference))
    peft = get_peft_model(reference, config, adapter_name="t0")
    peft.add_adapter("t1", config)
    for name, state in zip(("t0", "t1"), states):
        set_peft_model_state_dict(peft, state, adapter_name=name)
    got, checked = dict(model.named_parameters()), 0
    weights = torch.tensor([0.8, 0.8])
    for name, layer in peft.named_modules():
        if hasattr(layer, "lora_A") and "t0" in layer.lora_A:
            deltas = [layer.get_delta_weight(a) for a in ("t0", "t1")]
            merged = (merge_utils.ties(deltas, weights, 0.5, "total") if combination == "ties"
                      else merge_utils.task_arithmetic(deltas, weights))
            assert (combination == "ties") != torch.allclose(merged, 0.8 * (deltas[0] + deltas[1]))
            key = name.removeprefix("base_model.model.") + ".weight"
            torch.testing.assert_close(got[key], layer.base_layer.weight + merged, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == 4 * 7
