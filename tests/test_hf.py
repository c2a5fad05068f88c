"""ADEPTCallback inside a real transformers.Trainer run on a tiny model."""
import torch
from transformers import Trainer, TrainingArguments

from adept_ext.expand import expand_layers
from adept_ext.hf import ADEPTCallback
from adept_ext.lr import param_groups
from tiny_models import padded_batches, tiny_model


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


def test_recompute_follows_the_trainers_precision(tmp_path):
    model = tiny_model("llama", layers=3)
    expand_layers(model, [1])
    rows = [{k: v[i] for k, v in batch.items()} for batch in padded_batches(n_batches=1) for i in range(3)]
    callback = ADEPTCallback(padded_batches(n_batches=1, seed=5), every=1)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=2, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=True)
    Trainer(model=model, args=args, train_dataset=rows, optimizers=(torch.optim.AdamW(param_groups(model, 1e-3)), None),
            callbacks=[callback]).train()
    assert callback.decoupled.importance.autocast_dtype == torch.bfloat16 and callback.decoupled.recomputes == 1


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
