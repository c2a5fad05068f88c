"""ADEPTCallback inside a real transformers.Trainer run on a tiny model."""
import gc
import weakref

import pytest
import torch
from tiny_models import padded_batches, tiny_model
from transformers import Trainer, TrainerCallback, TrainingArguments

import adept_ext
from adept_ext.adept.expand import expand_layers
from adept_ext.hf import ADEPTCallback, MethodCallback
from adept_ext.adept.lr import DecoupledLR, param_groups
from adept_ext.methods import AdeptConfig


def test_trainer_end_to_end(tmp_path):
    model = tiny_model("llama", layers=3)
    expand_layers(model, [1])
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    copies = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rows = [{k: v[i] for k, v in batch.items()} for batch in padded_batches(n_batches=4) for i in range(3)]
    callback = ADEPTCallback(padded_batches(n_batches=1, seed=5), every=2)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=4, logging_steps=1,
                             learning_rate=1e-3, warmup_steps=1, lr_scheduler_type="linear", report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      optimizers=(torch.optim.AdamW(param_groups(model, 1e-3)), None), callbacks=[callback])
    trainer.train()
    assert callback.decoupled.steps == 4 and callback.decoupled.recomputes == 1  # at step 2; none after the last
    logged = [entry for entry in trainer.state.log_history if "adept_mean_lr_multiplier" in entry]
    assert logged and any(k.startswith("adept_lr/model.layers.2.") for k in logged[-1])
    assert all(torch.equal(p, originals[n]) for n, p in model.named_parameters() if n in originals)
    assert any(not torch.equal(p, copies[n]) for n, p in model.named_parameters() if n in copies)


@pytest.mark.parametrize("bf16", [True, False])
def test_recompute_follows_the_trainers_precision(tmp_path, monkeypatch, bf16):
    """The callback's recompute runs the model's forward under bf16 autocast when args.bf16 is set,
    in fp32 otherwise, seen only while a recompute runs: the autocast the recompute itself sets up
    (a pre-hook on the model, outside the forward that accelerate wraps in the Trainer's own autocast
    under bf16) and the dtype an expanded layer's projection computed in (a forward hook)."""
    model = tiny_model("llama", layers=3)
    expand_layers(model, [1])
    rows = [{k: v[i] for k, v in batch.items()} for batch in padded_batches(n_batches=1) for i in range(3)]
    callback = ADEPTCallback(padded_batches(n_batches=1, seed=5), every=1)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=2, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=bf16)
    recomputing, asked, seen = [False], [], []
    real_recompute = DecoupledLR.recompute

    def recompute(self):
        recomputing[0] = True
        try:
            return real_recompute(self)
        finally:
            recomputing[0] = False

    monkeypatch.setattr(DecoupledLR, "recompute", recompute)
    copy = model.model.layers[2].mlp.up_proj  # layer 1's copy: a unit the importance scores

    def computed_in(module, inputs, out):  # returns None: the output is left as it is
        if recomputing[0]:
            seen.append(out.dtype)

    def autocast_set_up(module, inputs):
        if recomputing[0]:
            asked.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)

    handles = [copy.register_forward_hook(computed_in), model.register_forward_pre_hook(autocast_set_up)]
    try:
        Trainer(model=model, args=args, train_dataset=rows,
                optimizers=(torch.optim.AdamW(param_groups(model, 1e-3)), None), callbacks=[callback]).train()
    finally:
        for h in handles:
            h.remove()
    assert callback.decoupled.recomputes == 1  # after step 1; none after the last
    want = torch.bfloat16 if bf16 else torch.float32
    assert asked == [want], asked  # one probe batch, one forward
    assert seen == [want], seen


def test_rates_are_applied_by_the_trainers_step_events_not_optimizer_hooks(tmp_path):
    """During each optimizer step every unit's group holds the scheduled lr times its multiplier,
    set by the callback's Trainer events (no hooks on the optimizer), and restored after it."""
    model = tiny_model("llama", layers=3)
    expand_layers(model, [1])
    rows = [{k: v[i] for k, v in batch.items()} for batch in padded_batches(n_batches=1) for i in range(3)]
    seen = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            seen.append([g["lr"] for g in self.param_groups])
            return super().step(closure)

    optimizer = Recording(param_groups(model, 1e-3))
    callback = ADEPTCallback(padded_batches(n_batches=1, seed=5), every=1)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=3, report_to=[],
                             learning_rate=1e-3, lr_scheduler_type="constant", save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    multipliers = []
    trainer = Trainer(model=model, args=args, train_dataset=rows, optimizers=(optimizer, None), callbacks=[callback])
    real_begin = callback.on_pre_optimizer_step

    def begin(*a, **kw):
        multipliers.append(list(callback.decoupled.multipliers))
        return real_begin(*a, **kw)

    callback.on_pre_optimizer_step = begin
    trainer.train()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert len(seen) == 3 and callback.decoupled.steps == 3
    for lrs, m in zip(seen, multipliers):
        assert lrs == [1e-3 * x for x in m]
    assert all(g["lr"] == 1e-3 for g in optimizer.param_groups)  # restored after the last step


def _resumable_trainer(model, out, callback, stop_at=None, groups=None, compute_loss=None):
    """A Trainer over the same 12 rows in order, checkpointing every 2 of its 4 steps; it stops
    after step `stop_at` (a kill after a checkpoint) when given."""
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    rows = [{k: v[i] for k, v in batch.items()} for batch in padded_batches(n_batches=4) for i in range(3)]
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=3, max_steps=4, learning_rate=1e-3,
                             save_strategy="steps", save_steps=2, restore_callback_states_from_checkpoint=True,
                             train_sampling_strategy="sequential", report_to=[], use_cpu=True, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback, Stop()],
                   optimizers=(torch.optim.AdamW(groups or param_groups(model, 1e-3)), None),
                   compute_loss_func=compute_loss)


def _expanded():
    model = tiny_model("llama", layers=3)
    expand_layers(model, [1])
    return model


def test_a_resumed_trainer_continues_the_rates(tmp_path):
    """ADEPTCallback's rates travel in the Trainer's checkpoints: killed after the step-2 checkpoint
    and resumed from it, the run ends with the uninterrupted run's rates, counts and weights."""
    probe = padded_batches(n_batches=1, seed=5)
    whole_model = _expanded()
    whole = ADEPTCallback(probe, every=3, name="whole")
    _resumable_trainer(whole_model, tmp_path / "whole", whole).train()

    killed = ADEPTCallback(probe, every=3, name="killed")
    _resumable_trainer(_expanded(), tmp_path / "killed", killed, stop_at=2).train()
    resumed_model = _expanded()
    trainer = _resumable_trainer(resumed_model, tmp_path / "killed", ADEPTCallback(probe, every=3, name="killed"))
    trainer.train(resume_from_checkpoint=str(tmp_path / "killed" / "checkpoint-2"))
    (resumed,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, ADEPTCallback)]
    assert resumed.decoupled.steps == whole.decoupled.steps == 4
    assert resumed.decoupled.recomputes == whole.decoupled.recomputes == 1  # at step 3: after the resume
    assert resumed.decoupled.scores == pytest.approx(whole.decoupled.scores, rel=1e-6)
    for (name, a), b in zip(whole_model.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_resumed_trainer_continues_any_methods_state(tmp_path):
    """MethodCallback: the method's state (here ADEPT's rates) travels in the Trainer's checkpoints."""
    probe = padded_batches(n_batches=1, seed=5)

    def prepared(name):
        method = adept_ext.get_method(AdeptConfig(k=1, recompute_every=3))
        task = adept_ext.prepare(tiny_model("llama", layers=3), method, general_probe=probe, lr=1e-3, total_steps=4,
                                 progress=False)
        callback = MethodCallback(task, name=name)
        return task, callback, dict(groups=task.param_groups, compute_loss=callback.compute_loss)

    whole, _, resumed = _whole_killed_and_resumed(prepared, tmp_path, "")
    a, b = whole.method.decoupled, resumed.method.decoupled
    assert (b.steps, b.recomputes) == (a.steps, a.recomputes) == (4, 1)
    assert b.scores == pytest.approx(a.scores, rel=1e-6)
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _whole_killed_and_resumed(prepared, tmp_path, prefix: str):
    """Three Trainer runs of the task `prepared(name)` returns (task, callback, trainer kwargs): whole,
    killed after step 2, and resumed from that checkpoint; returns the three tasks."""
    whole, callback, kw = prepared(f"{prefix}whole")
    _resumable_trainer(whole.model, tmp_path / "whole", callback, **kw).train()
    killed, callback, kw = prepared(f"{prefix}killed")
    _resumable_trainer(killed.model, tmp_path / "killed", callback, stop_at=2, **kw).train()
    resumed, callback, kw = prepared(f"{prefix}killed")
    _resumable_trainer(resumed.model, tmp_path / "killed", callback, **kw).train(
        resume_from_checkpoint=str(tmp_path / "killed" / "checkpoint-2"))
    return whole, killed, resumed


def test_a_resumed_trainer_continues_an_osf_task(tmp_path):
    """MethodCallback with OSF (docs/methods.md §6): the trainable singular factors travel in the
    Trainer's checkpoint and the resumed task (its SVD recomputed from the same weights) ends, merged,
    with the uninterrupted task's weights."""
    def prepared(name):
        method = adept_ext.get_method(adept_ext.methods.OsfMethodConfig())
        task = adept_ext.prepare(tiny_model("llama", layers=2), method, lr=1e-3, total_steps=4, progress=False)
        callback = MethodCallback(task, name=name)
        return task, callback, dict(groups=task.param_groups, compute_loss=callback.compute_loss)

    whole, killed, resumed = _whole_killed_and_resumed(prepared, tmp_path, "osf-")
    a, b, cut = whole.finish(), resumed.finish(), killed.finish()
    assert type(a).__name__ == type(b).__name__ == "LlamaForCausalLM"
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), cut.parameters()))  # steps 3, 4 count
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _lora_task(seed=0):
    method = adept_ext.get_method(adept_ext.methods.LoraMethodConfig(rank=2))
    return adept_ext.prepare(tiny_model("llama", layers=2, seed=seed), method, lr=1e-3, total_steps=2,
                             progress=False)


def test_callbacks_hold_tasks_and_models_by_weak_reference(tmp_path):
    """A deleted task (and its model) is freed while its MethodCallback lives; the callback then
    says so, and its name is free again. An ADEPTCallback's registry keeps no model alive."""
    task = _lora_task()
    callback = MethodCallback(task, name="weak")
    task_ref, model_ref = weakref.ref(task), weakref.ref(task.model)
    del task
    gc.collect()
    assert task_ref() is None and model_ref() is None
    with pytest.raises(RuntimeError, match="its task was freed"):
        callback.state()  # what the Trainer asks for at a checkpoint
    with pytest.raises(ValueError, match="no task was registered"):
        MethodCallback(name="weak")  # nothing for a Trainer to rebuild from
    MethodCallback(_lora_task(), name="weak")  # the name is free again
    del callback
    gc.collect()
    assert "weak" not in MethodCallback._live  # nor does the registry keep callbacks

    model = _expanded()
    callback = ADEPTCallback(padded_batches(n_batches=1, seed=5), every=2, name="weak")
    trainer = _resumable_trainer(model, tmp_path, callback, stop_at=1)
    trainer.train()
    model_ref = weakref.ref(model)
    del model, trainer, callback
    gc.collect()
    assert model_ref() is None and "weak" not in ADEPTCallback._live


def test_live_callbacks_need_their_own_names(tmp_path):
    """A second callback under a live one's name is refused; two under different names train side
    by side, each its own task, and each Trainer resuming rebuilds its callback with its own task;
    once a Trainer's training has ended its name can be taken again."""
    probe = padded_batches(n_batches=1, seed=5)
    tasks = {}
    for name in ("first", "second"):
        method = adept_ext.get_method(AdeptConfig(k=1, recompute_every=3))
        tasks[name] = adept_ext.prepare(tiny_model("llama", layers=3), method, general_probe=probe, lr=1e-3,
                                        total_steps=4, progress=False)
    callbacks = {name: MethodCallback(task, name=name) for name, task in tasks.items()}
    with pytest.raises(ValueError, match="another callback under this name is live"):
        MethodCallback(tasks["first"], name="first")
    adept = ADEPTCallback(probe, name="first")  # another class, another registry
    with pytest.raises(ValueError, match="another callback under this name is live"):
        ADEPTCallback(probe, name="first")
    trainers = {name: _resumable_trainer(task.model, tmp_path / name, callbacks[name], groups=task.param_groups,
                                         compute_loss=callbacks[name].compute_loss) for name, task in tasks.items()}
    for trainer in trainers.values():
        trainer.train()
    for name, task in tasks.items():
        assert task.method.decoupled.steps == 4  # each task's rates followed its own Trainer only
        resumed = _resumable_trainer(task.model, tmp_path / name, MethodCallback(task, name=name),
                                     groups=task.param_groups)  # allowed: the first's training ended
        resumed.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-2"))
        (rebuilt,) = [c for c in resumed.callback_handler.callbacks if isinstance(c, MethodCallback)]
        assert rebuilt.task is task and rebuilt is not callbacks[name]
    del adept


def _record_penalty_weights(method) -> list:
    """The gradient that reaches each penalty term in each backward (its weight in the loss backpropagated),
    appended to the returned list."""
    weights, penalties = [], method.penalties

    def recorded(model):
        terms = penalties(model)
        for term in terms:
            term.register_hook(lambda grad: weights.append(float(grad)))
        return terms

    method.penalties = recorded
    return weights


ACCUMULATION = 8


def _trainer_penalty_worker(rank, world, port, out):
    """One torchrun-like process: one optimizer step of an O-LoRA second task by the Trainer (8 micro-batches of
    one row per rank, gloo); saves the penalty's summed weight in this rank's backward passes."""
    import os

    from test_o_lora import second_task

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    _, method, task = second_task("fro2")
    weights = _record_penalty_weights(method)
    callback = MethodCallback(task)
    rows = [{k: v[i] for k, v in batch.items()} for batch in padded_batches(n_batches=6) for i in range(3)]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=ACCUMULATION,
                             max_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    Trainer(model=task.model, args=args, train_dataset=rows, callbacks=[callback],
            compute_loss_func=callback.compute_loss, optimizers=(torch.optim.SGD(task.param_groups), None)).train()
    torch.save([len(weights), sum(weights)], f"{out}/weight.{rank}")


def test_the_penalty_weighs_once_per_trainer_step_as_in_the_runners(tmp_path):
    """Under the Trainer with 8 accumulation steps on 2 gloo processes, O-LoRA's penalty weighs what it weighs in
    the runners' step (`Method.loss` over 8 micro-batches): 1 per optimizer step (the ranks' gradients averaged),
    not accumulation × processes."""
    import ranks
    from test_distributed import _free_port
    from test_o_lora import second_task

    model, method, task = second_task("fro2")
    weights = _record_penalty_weights(method)
    for batch in padded_batches(n_batches=ACCUMULATION, batch=1):
        task.loss(batch, micro_batches=ACCUMULATION).backward()
    assert len(weights) == ACCUMULATION
    runner = sum(weights)
    ranks.spawn(_trainer_penalty_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        count, weight = torch.load(tmp_path / f"weight.{rank}", weights_only=True)
        assert count == ACCUMULATION
        assert weight == pytest.approx(runner, rel=1e-6) and runner == pytest.approx(1.0, rel=1e-6)
