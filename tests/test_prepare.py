"""`adept_ext.prepare` in a plain PyTorch loop, and in `transformers.Trainer` through
`hf.MethodCallback`, trains to the same losses and weights as the runners (`adept-ext run` /
`adept-ext continual`) on the same data, for every method family."""
import math
import random

import pytest
import torch
from test_continual import options as sequence_options
from test_train import options as run_options
from tiny_models import tiny_model, write_sequence_workspace
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

import adept_ext
from adept_ext import continual, data, train
from adept_ext.training import one_domain
from adept_ext.errors import InputError
from adept_ext.hf import MethodCallback
from adept_ext.methods import REGISTRY
from adept_ext.models import load_model


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_sequence_workspace(tmp_path_factory.mktemp("prepare"))


def warmup_cosine(warmup, steps):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))
    return factor


def plain_loop(task, batches, cfg):
    """What a user writes: torch's AdamW over the task's groups, warmup + cosine, clipping."""
    optimizer = torch.optim.AdamW(task.param_groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps))
    task.attach(optimizer)
    losses = []
    for step, batch in zip(range(cfg.steps), task.batches(batches[i % len(batches)] for i in range(cfg.steps))):
        loss = task.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.trainable, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


class _RestoreRng(TrainerCallback):
    """The Trainer seeds every generator when it is built and its data loader draws a seed when
    its iterator starts; the runner's draws continue instead: the state from before the Trainer
    at the first step (EoupCT's Gumbel noise is drawn in the steps, the next task's adapters after
    them)."""

    def __init__(self):
        self.state = torch.get_rng_state(), random.getstate()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            torch.set_rng_state(self.state[0])
            random.setstate(self.state[1])


def trainer_loop(task, batches, cfg, out):
    """The same training in transformers.Trainer: the runner's batches in order, its optimizer,
    schedule and clipping; the method through MethodCallback."""
    rows = [{k: v[i] for k, v in batches[s % len(batches)].items()} for s in range(cfg.steps)
            for i in range(len(batches[s % len(batches)]["input_ids"]))]
    optimizer = torch.optim.AdamW(task.param_groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps))
    callback = MethodCallback(task)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=cfg.batch_size, max_steps=cfg.steps,
                             max_grad_norm=cfg.max_grad_norm, train_sampling_strategy="sequential", report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no")
    restore = _RestoreRng()
    trainer = Trainer(model=task.model, args=args, train_dataset=rows, optimizers=(optimizer, scheduler),
                      callbacks=[restore, callback], compute_loss_func=callback.compute_loss)
    trainer.train()


def assert_same_weights(model, saved_dir):
    saved = AutoModelForCausalLM.from_pretrained(saved_dir).state_dict()
    got = model.state_dict()
    assert saved.keys() == got.keys()
    for name, value in saved.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def method_of(cfg, sequence):
    """The method as a user builds it: its own config, through get_method."""
    name = cfg.method
    return adept_ext.get_method(REGISTRY[name].config_class.from_options(cfg))


RUNS = {}


def runner_report(workspace, kind, method, loop):
    """The runner's report for `method` (run once per module and loss, shared by the tests). The
    Trainer computes the model's own loss: its runner runs --loss-implementation hf, the plain
    loop's the default (fused), as `task.loss` does."""
    loss = "hf" if loop == "trainer" else "auto"
    if (kind, method, loss) not in RUNS:
        out = f"prepare-{method}-{loss}"
        if kind == "run":
            cfg = run_options(workspace, out, method=method, eval_every=0, save_every=0, loss_implementation=loss)
            RUNS[kind, method, loss] = cfg, train.run(cfg, progress=False, log=lambda *a: None)
        else:
            cfg = sequence_options(workspace, out, method=method, save_every=0, loss_implementation=loss)
            RUNS[kind, method, loss] = cfg, continual.run(cfg, progress=False, log=lambda *a: None)
    return RUNS[kind, method, loss]


@pytest.mark.parametrize("loop", ["plain", "trainer"])
@pytest.mark.parametrize("method", ["adept", "lora", "llama_pro", "freeze_deep"])
def test_prepare_equals_the_run(workspace, tmp_path, method, loop):
    cfg, report = runner_report(workspace, "run", method, loop)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    corpora = data.Corpora(cfg, tokenizer)
    task = adept_ext.prepare(model, method_of(cfg, False), general_probe=corpora.general_probe,
                             domain_probe=corpora.domain_probe, lr=cfg.lr, total_steps=cfg.steps,
                             diagnosis_batches=lambda: one_domain.diagnosis_batches(cfg, corpora), progress=False)
    if loop == "plain":
        losses = plain_loop(task, corpora.domain_train, cfg)
        assert losses == pytest.approx([h["loss"] for h in report["history"]["train"]], rel=1e-6)
    else:
        trainer_loop(task, corpora.domain_train, cfg, tmp_path)
    finished = task.finish()
    assert one_domain.evaluate(finished, corpora.domain_eval, "cpu", progress=False,
                          loss_implementation=cfg.loss_implementation) == pytest.approx(
        report["final"]["domain_loss"], rel=1e-6)
    assert_same_weights(finished, cfg.out + "/model")


@pytest.mark.parametrize("loop", ["plain", "trainer"])
@pytest.mark.parametrize("method", ["o_lora", "osf", "replay", "eoupct", "deal", "adept_seq", "ewc", "agem"])
def test_prepare_equals_the_sequence(workspace, tmp_path, method, loop):
    cfg, report = runner_report(workspace, "continual", method, loop)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    sequence = data.TaskSequence(cfg, tokenizer)  # what the runner trains on, as a user's loop builds it
    method_ = method_of(cfg, True)
    for t in range(len(sequence.tasks)):
        task = adept_ext.prepare(model, method_, general_probe=sequence.general_probe, lr=cfg.lr,
                                 total_steps=cfg.steps, task_index=t, domain_probe=sequence.domain_probe(t),
                                 progress=False)
        batches = sequence.train_batches(t, method_.train_blocks)
        if loop == "plain":
            losses = plain_loop(task, batches, cfg)
            assert losses == pytest.approx([h["loss"] for h in report["history"][t]], rel=1e-6), f"task {t + 1}"
        else:
            trainer_loop(task, batches, cfg, tmp_path / f"task-{t}")
        model = task.finish()
        for p in model.parameters():
            p.requires_grad_(False)
    assert_same_weights(model, cfg.out + "/model")


def test_prepare_refuses_impossible_settings_before_touching_the_model():
    model = tiny_model("llama")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    method = adept_ext.get_method(REGISTRY["lora"].config_class())
    for kw, message in ((dict(lr=0.0, total_steps=4), "lr must be"),
                        (dict(lr=float("nan"), total_steps=4), "lr must be"),
                        (dict(lr=1e-3, total_steps=0), "total_steps"),
                        (dict(lr=1e-3, total_steps=4, weight_decay=-1), "weight_decay")):
        with pytest.raises(InputError, match=message):
            adept_ext.prepare(model, method, **kw)
    assert type(model).__name__ == "LlamaForCausalLM"  # not wrapped by PEFT
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


@pytest.mark.parametrize("name", ["lora", "adept"])
def test_a_second_prepare_is_refused_until_the_task_is_finished(name):
    """A model prepared and not finished is refused (unchanged) by a second prepare; the finished
    model is prepared for the next task as usual (ADEPT: an expanded model, config.adept, trains its
    copies), and a task finishes once."""
    from tiny_models import padded_batches

    config = REGISTRY[name].config_class(**({"k": 1} if name == "adept" else {}))
    method = adept_ext.get_method(config)
    model, probe = tiny_model("llama", layers=3), padded_batches(n_batches=1)
    task = adept_ext.prepare(model, method, general_probe=probe, lr=1e-3, total_steps=2, progress=False)
    task.attach(torch.optim.AdamW(task.param_groups))
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(InputError, match=f"already prepared for a task \\({name}\\) that was not finished"):
        adept_ext.prepare(model, method, general_probe=probe, lr=1e-3, total_steps=2, progress=False)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[n], p) for n, p in after.items())
    finished = task.finish()
    with pytest.raises(InputError, match="finished already"):
        task.finish()
    if name == "adept":
        assert finished.config.adept["expanded_layers"]
    task = adept_ext.prepare(finished, method, general_probe=probe, lr=1e-3, total_steps=2, progress=False)
    task.attach(torch.optim.AdamW(task.param_groups))
    if name == "adept":  # the copies of the first task are trained, none added
        assert model.config.num_hidden_layers == 4
        assert task.layers == finished.config.adept["source_layers_before_expansion"]
    task.finish()
