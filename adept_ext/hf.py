"""transformers.Trainer integration: any method through `MethodCallback` (a task prepared by
`adept_ext.prepare`), and ADEPT's decoupled learning rates alone through `ADEPTCallback`
(docs/methods.md §1.3).

Each callback has a `name` (the Trainer rebuilds a callback from it when it resumes a checkpoint
with `restore_callback_states_from_checkpoint`): the callbacks are registered under their names
by weak reference only, so the registry keeps no task, model or callback alive. A callback is
live from its creation until its Trainer's training ends (a MethodCallback: while its task is
also alive and not finished); a second callback under the name of a live one is refused, so
Trainers that run side by side take different names."""
import base64
import io
import weakref
from typing import Dict, Optional

import torch
from transformers import TrainerCallback
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.trainer_callback import ExportableState

from .adept.lr import DecoupledLR
from .methods.task import Task
from .adept.units import UnitImportance


class MethodCallback(TrainerCallback, ExportableState):
    """A task of any method (`adept_ext.prepare`) trained by `transformers.Trainer`:

        task = adept_ext.prepare(model, method, general_probe=probe, lr=1e-3, total_steps=args.max_steps)
        callback = MethodCallback(task)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback],
                          optimizers=(torch.optim.AdamW(task.param_groups), None),
                          compute_loss_func=callback.compute_loss)
        trainer.train()
        model = task.finish()  # a plain Hugging Face model

    When training begins the method's optimizer-step hooks go on the Trainer's torch optimizer
    (ADEPT's per-unit rates, EoupCT's projection); `compute_loss` is Hugging Face's causal-LM loss
    plus the method's penalty (O-LoRA, DEAL), weighed once per optimizer step as in the runners
    (`Method.training_loss`), whatever the gradient accumulation and the number of processes. The
    method's state travels in the Trainer's checkpoints (`ExportableState`, in trainer_state.json):
    on `resume_from_checkpoint` with `TrainingArguments(restore_callback_states_from_checkpoint=True)`
    the Trainer rebuilds this callback from its `name` (the task of the callback registered under
    it) and the saved state is loaded before the first step.

    The callback holds its task by weak reference: keep the task (its `finish()` ends the
    training). Two Trainers training at the same time need two names."""

    _live: "weakref.WeakValueDictionary[str, MethodCallback]" = weakref.WeakValueDictionary()

    def __init__(self, task: Task = None, name: str = "adept_ext"):
        registered = MethodCallback._live.get(name)
        if task is None:  # rebuilt by the Trainer from a checkpoint: the registered callback's task
            task = registered.task_or_none() if registered is not None else None
            if task is None:
                raise ValueError(f"MethodCallback {name!r}: no task was registered under this name; "
                                 "pass the task prepared by adept_ext.prepare")
        elif task.method.own_loss_terms:
            raise ValueError(f"MethodCallback: {task.method.name}'s loss is not the Trainer's token loss plus a "
                             "penalty (replay's --replay-distill reads each row's buffer slot, its --answer-loss "
                             "scores answers over another softmax); train it with the runners or a loop that calls "
                             "task.loss")
        elif registered is not None and registered.live():
            raise ValueError(f"MethodCallback {name!r}: another callback under this name is live (its task is not "
                             f"finished and its training has not ended); give this one another name (two Trainers "
                             f"at once need two), or finish the other's task first")
        self.task, self.name, self.saved_state, self.ended, self.args = task, name, None, False, None
        MethodCallback._live[name] = self

    def task_or_none(self) -> Optional[Task]:
        return self._task()

    @property
    def task(self) -> Task:
        task = self._task()
        if task is None:
            raise RuntimeError(f"MethodCallback {self.name!r}: its task was freed; keep the task that "
                               "adept_ext.prepare returned until training ends (the callback holds it by weak "
                               "reference) and call its finish() after")
        return task

    @task.setter
    def task(self, task: Task):
        self._task = weakref.ref(task)

    def live(self) -> bool:
        """Until training ends, while the task is alive and not finished."""
        task = self._task()
        return not self.ended and task is not None and not getattr(task, "finished", False)

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        """The Trainer's `compute_loss_func`: the method's `training_loss` of Hugging Face's causal-LM
        loss of `outputs`, its penalties weighing 1 per optimizer step as in the runners. While
        training, the Trainer backpropagates `gradient_accumulation_steps` losses per step and does
        not divide a `compute_loss_func` loss by them; given `num_items_in_batch` (the step's
        labelled tokens) with `average_tokens_across_devices`, it multiplies the loss by its process
        count (`n_gpu` under DataParallel), which the data-parallel average then divides out. An
        evaluation's loss (model in eval mode) adds the whole penalties. Not accounted for: tensor
        parallelism (the Trainer then divides its factor by the TP size), a Trainer subclass that
        sets `loss_is_scaled_for_ga = False`, and an epoch's last step with fewer micro-batches
        (its penalty weighs their share of `gradient_accumulation_steps`)."""
        loss = ForCausalLMLoss(outputs.logits, labels, vocab_size=outputs.logits.shape[-1],
                               num_items_in_batch=num_items_in_batch)
        args, model = self.args, self.task.model
        if args is None or not model.training:
            return self.task.method.training_loss(loss, model)
        scaled = args.average_tokens_across_devices and num_items_in_batch is not None
        processes = (args.n_gpu if args.n_gpu > 1 else args.world_size) if scaled else 1
        return self.task.method.training_loss(loss, model, args.gradient_accumulation_steps, processes)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.args = args  # the accumulation and process count `compute_loss` accounts for
        self.task.attach(getattr(optimizer, "optimizer", optimizer))  # accelerate wraps the torch optimizer

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = True

    def on_step_begin(self, args, state, control, **kwargs):
        if self.saved_state is not None:  # restored from a checkpoint by the Trainer (after on_train_begin)
            self.task.load_state_dict(torch.load(io.BytesIO(base64.b64decode(self.saved_state)), weights_only=True))
            self.saved_state = None

    def state(self) -> Dict:
        buffer = io.BytesIO()
        torch.save(self.task.state_dict(), buffer)
        return {"args": {"name": self.name},
                "attributes": {"saved_state": base64.b64encode(buffer.getvalue()).decode("ascii")}}


class ADEPTCallback(TrainerCallback, ExportableState):
    """Attaches `DecoupledLR` to the Trainer's optimizer when training starts, recomputes the
    unit importance every `every` optimizer steps, and logs the per-unit rates.

    The optimizer must have one param group per unit: pass
    ``optimizers=(torch.optim.AdamW(adept_ext.adept.lr.param_groups(model, lr)), None)`` to the
    Trainer (it then builds its own scheduler on top, which composes with the multipliers).
    The recompute runs in the training's precision: under autocast bf16/fp16 when the Trainer's
    `args.bf16`/`args.fp16` is set (`autocast_dtype="auto"`, the default), or as given.
    The multipliers are applied by the Trainer's own `on_pre_optimizer_step`/`on_optimizer_step`
    events around its optimizer step (`DecoupledLR(hooks=False)`), not by the torch optimizer's
    step hooks, so an optimizer wrapper that never runs those hooks (DeepSpeed, FSDP's) works too.
    The rates' state (scores, step and recompute counts) travels in the Trainer's checkpoints
    (`ExportableState`): on `resume_from_checkpoint` with
    `TrainingArguments(restore_callback_states_from_checkpoint=True)` the Trainer rebuilds the
    callback from its `name` (the probe batches and rates of the callback registered under it) and
    the saved rates continue. Callbacks are registered by weak reference (the registry keeps no
    model alive); a second one under the name of a live one (created, its training not ended) is
    refused: Trainers that run side by side take different names.
    """

    _live: "weakref.WeakValueDictionary[str, ADEPTCallback]" = weakref.WeakValueDictionary()

    def __init__(self, probe_batches=None, every: int = 100, mode: str = "abs", normalize: str = "rank",
                 floor: float = 0.1, autocast_dtype="auto", name: str = "adept"):
        registered = ADEPTCallback._live.get(name)
        if probe_batches is None:  # rebuilt by the Trainer from a checkpoint: the registered one's batches and rates
            if registered is None:
                raise ValueError(f"ADEPTCallback {name!r}: pass probe_batches (no callback was registered under "
                                 "this name)")
            self.probe_batches, self.decoupled = registered.probe_batches, registered.decoupled
        else:
            if registered is not None and not registered.ended:
                raise ValueError(f"ADEPTCallback {name!r}: another callback under this name is live (its training "
                                 f"has not ended); give this one another name (two Trainers at once need two)")
            self.probe_batches, self.decoupled = list(probe_batches), None
        self.ended = False
        self.every, self.mode, self.normalize, self.floor = every, mode, normalize, floor
        self.autocast_dtype = getattr(torch, autocast_dtype) if autocast_dtype in ("bfloat16", "float16") \
            else autocast_dtype
        self.name, self.saved_rates = name, None
        ADEPTCallback._live[name] = self

    def state(self) -> Dict:
        dtype = self.autocast_dtype
        return {"args": {"every": self.every, "mode": self.mode, "normalize": self.normalize, "floor": self.floor,
                         "autocast_dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
                         "name": self.name},
                "attributes": {"saved_rates": None if self.decoupled is None else
                               {**self.decoupled.state_dict(), "scores": [float(s) for s in self.decoupled.scores]}}}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        dtype = self.autocast_dtype
        if dtype == "auto":
            dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        importance = UnitImportance(model, self.probe_batches, mode=self.mode, normalize=self.normalize,
                                    autocast_dtype=dtype)
        self.decoupled = DecoupledLR(optimizer, importance, every=self.every, floor=self.floor,
                                     last_step=state.max_steps or None, hooks=False,
                                     autocast_dtype=None)  # the importance's, from args (accelerate wraps forward)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.saved_rates is not None:  # restored from a checkpoint by the Trainer (after on_train_begin)
            self.decoupled.load_state_dict(self.saved_rates)
            self.saved_rates = None
        self.decoupled.step_begin()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.decoupled.step_end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Adds the mean multiplier, the recompute count and every unit's current rate to the
        logged values and to the Trainer's saved log history."""
        if self.decoupled is None or logs is None:
            return
        extra = {"adept_mean_lr_multiplier": self.decoupled.mean_multiplier,
                 "adept_recomputes": self.decoupled.recomputes,
                 **{f"adept_lr/{name}": rate for name, rate in self.decoupled.rates().items()}}
        logs.update(extra)
        if state.log_history:
            state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = True
        if self.decoupled is not None:
            self.decoupled.remove()
