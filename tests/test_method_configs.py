"""Every method behind its own config (adept_ext.methods): the configs build from both runners'
options and equal their defaults, map every flat option, refuse every invalid value with a
MethodError before anything is created, `get_method` returns the registered class, and a method
takes its training (lr, weight decay, steps, seed) from the Context, not from runner options."""
import dataclasses
import math
import re
import types

import pytest
import torch
from tiny_models import padded_batches, tiny_model

import adept_ext.methods as methods
from adept_ext.continual import ContinualConfig
from adept_ext.methods import (
    REGISTRY,
    AdeptConfig,
    AdeptNoExpandConfig,
    AdeptSeqConfig,
    AdeptUniformLrConfig,
    Context,
    DealConfig,
    EoupCTConfig,
    FreezeDeepConfig,
    LlamaProConfig,
    LlamaProSeqConfig,
    LoraMethodConfig,
    MethodConfig,
    MethodError,
    OLoraConfig,
    OsfMethodConfig,
    PerTaskConfig,
    ReplayConfig,
    SeqLoraConfig,
    create,
    get_method,
)
from adept_ext.methods.adept import LayerConfig
from adept_ext.train import RunConfig

NAMES = list(REGISTRY)
CONFIGS = {name: cls.config_class for name, cls in REGISTRY.items()}


def runner_of(name):
    """The runner options that run method `name` (RunConfig for one domain, ContinualConfig for a sequence)."""
    return RunConfig if REGISTRY[name].single_domain else ContinualConfig


def flat_name(config_class, field_name):
    return next(f.metadata.get("option", f.name) for f in dataclasses.fields(config_class) if f.name == field_name)


# ---------------------------------------------------------------- configs and registry
@pytest.mark.parametrize("name", NAMES)
def test_every_method_has_an_exported_config_that_names_it(name):
    config_class = CONFIGS[name]
    assert issubclass(config_class, MethodConfig) and config_class.method == name
    assert getattr(methods, config_class.__name__) is config_class and config_class.__name__ in methods.__all__
    method = get_method(config_class())
    assert type(method) is REGISTRY[name] and method.config == config_class()
    assert not hasattr(method, "cfg")


def test_config_classes_are_distinct_and_exported_with_get_method():
    assert len(set(CONFIGS.values())) == len(CONFIGS)
    for public in ("MethodConfig", "get_method", "create", "Context", "MethodError"):
        assert public in methods.__all__


@pytest.mark.parametrize("name", NAMES)
def test_configs_build_from_both_runners_defaults_and_equal_the_defaults(name):
    config_class = CONFIGS[name]
    own, other = runner_of(name), ContinualConfig if runner_of(name) is RunConfig else RunConfig
    assert config_class.from_options(own()) == config_class()
    expected = config_class()
    if "k" in {f.name for f in dataclasses.fields(config_class)}:  # k: 4 for `run`, 2 for `continual`
        expected = dataclasses.replace(expected, k=other().k)
    assert config_class.from_options(other()) == expected
    assert config_class.from_options(types.SimpleNamespace()) == config_class()  # no such options: the defaults


def test_the_layer_counts_default_like_their_runners():
    assert AdeptConfig().k == LlamaProConfig().k == RunConfig().k == 4
    assert AdeptSeqConfig().k == LlamaProSeqConfig().k == ContinualConfig().k == 2


# A distinct valid non-default value for every flat option a config reads (and the field value it becomes).
FLAT = {
    "k": 3, "layers": "5,1,1", "boundary": "2", "placement": "uniform", "normalize": "global", "recompute_every": 7,
    "diagnosis_task": "context", "lora_rank": 3, "replay_fraction": 0.5,
    "replay_base": "lora", "replay_ratio": 0.25, "replay_select": "surprise", "replay_distill": 0.5,
    "replay_distill_top_k": 7, "answer_loss": "label_space", "ema_decay": 0.9,
    "replay_temperature": 0.7, "label_replay": True, "o_lora_lambda": 0.25,
    "o_lora_penalty": "l1", "osf_effective_rank": 0.25, "osf_rank_step": 0.25,
    "deal_rank": 5, "deal_filter": "haar", "deal_filter_on": "b", "deal_scales": 2, "deal_lambda1": 0.5,
    "deal_a": 4.0, "deal_lambda2": 0.2, "deal_b": 3.0, "deal_new_rank": 3,
    "eoupct_student": "full", "eoupct_rank": 6, "eoupct_lora_alpha": 16.0, "eoupct_target_modules": "up_proj",
    "eoupct_teacher": "task_start", "eoupct_proxy": "embeds", "eoupct_proxy_len": 8,
    "eoupct_gen_steps": 2, "eoupct_tau": 0.5, "eoupct_alpha": 0.1, "eoupct_lambda": 0.3, "eoupct_proxy_every": 2,
    "eoupct_proxy_steps": 3, "eoupct_proxy_lr": 0.01, "eoupct_no_virtual": True, "eoupct_no_conflict": True,
    "eoupct_where": "grad", "eoupct_target": "logits", "eoupct_directions": 2, "eoupct_memory": "gpm",
    "ewc_lambda": 5.0, "ewc_gamma": 0.5, "ewc_samples": 4, "ewc_base": "full", "lwf_alpha": 0.25,
    "lwf_temperature": 1.5, "agem_batch": 2, "freeze_bottom": 1,
    "merge_tasks_combination": "dare_linear", "merge_tasks_density": 0.3, "merge_tasks_weight": 0.7,
}
PARSED = {"layers": [1, 5]}
# Options whose non-default value refuses some of FLAT's (deal_variant public_code: the paper's filter options).
EXCLUSIVE = {"deal_variant": "public_code", "replay_source": "none"}


@pytest.mark.parametrize("name", NAMES)
def test_from_options_maps_every_flat_option(name):
    config_class = CONFIGS[name]
    runner_fields = {f.name for f in dataclasses.fields(runner_of(name))}
    config = config_class.from_options(types.SimpleNamespace(**FLAT))
    for f in dataclasses.fields(config_class):
        option = flat_name(config_class, f.name)
        assert option in runner_fields, f"{config_class.__name__}.{f.name}: no runner option {option!r}"
        if option in EXCLUSIVE:
            alone = config_class.from_options(types.SimpleNamespace(**{option: EXCLUSIVE[option]}))
            assert getattr(alone, f.name) == EXCLUSIVE[option] != f.default, (f.name, option)
            continue
        expected = PARSED.get(option, FLAT[option])
        assert getattr(config, f.name) == expected != f.default, (f.name, option)


def test_the_renamed_options():
    assert flat_name(OLoraConfig, "lam") == "o_lora_lambda" and flat_name(EoupCTConfig, "lam") == "eoupct_lambda"
    assert flat_name(LoraMethodConfig, "rank") == flat_name(ReplayConfig, "rank") == "lora_rank"
    assert flat_name(DealConfig, "rank") == "deal_rank" and flat_name(EoupCTConfig, "rank") == "eoupct_rank"
    assert flat_name(ReplayConfig, "fraction") == "replay_fraction" and flat_name(ReplayConfig, "base") == "replay_base"
    options = RunConfig(layers="14,7,14", k=2)
    assert AdeptConfig.from_options(options) == AdeptConfig(k=2, layers=[7, 14])
    assert AdeptConfig.from_options(RunConfig(layers="")).layers is None


# ---------------------------------------------------------------- invalid values
# (config class, field values, message, the same as flat options or None)
INVALID = [
    (AdeptConfig, dict(k=0), "k must be >= 1, got 0", dict(k=0)),
    (AdeptConfig, dict(layers=[]), "layers must be a non-empty list of layer indices or None, got []", None),
    (AdeptConfig, dict(layers=[1.5]), "layers must be a non-empty list", None),
    (AdeptConfig, dict(layers="7,14"), "layers must be a non-empty list", None),
    (AdeptConfig, None, "--layers must be comma-separated layer indices, got '7,x'", dict(layers="7,x")),
    (AdeptConfig, dict(boundary="deep"), "boundary must be half, auto or a layer count, got 'deep'",
     dict(boundary="deep")),
    (AdeptConfig, dict(placement="nearest"), "placement must be one of importance, uniform", dict(placement="nearest")),
    (AdeptConfig, dict(normalize="zscore"), "normalize must be one of per_kind, global, rank, got 'zscore'",
     dict(normalize="zscore")),
    (AdeptConfig, dict(recompute_every=0), "recompute_every must be >= 1, got 0", dict(recompute_every=0)),
    (AdeptNoExpandConfig, dict(normalize="zscore"), "normalize must be one of", dict(normalize="zscore")),
    (AdeptUniformLrConfig, dict(placement="nearest"), "placement must be one of", dict(placement="nearest")),
    (LlamaProConfig, dict(k=0), "k must be >= 1", dict(k=0)),
    (LlamaProConfig, dict(layers=[True]), "layers must be a non-empty list", None),
    (FreezeDeepConfig, dict(boundary="deep"), "boundary must be half, auto or a layer count", dict(boundary="deep")),
    (FreezeDeepConfig, dict(boundary=12), "boundary must be half, auto or a layer count, got 12", None),
    (FreezeDeepConfig, dict(diagnosis_task="poetry"), "diagnosis_task must be one of bbc-topic, context, got 'poetry'",
     dict(diagnosis_task="poetry")),
    (LoraMethodConfig, dict(rank=0), "lora_rank must be >= 1, got 0", dict(lora_rank=0)),
    (SeqLoraConfig, dict(rank=0), "lora_rank must be >= 1, got 0", dict(lora_rank=0)),
    (PerTaskConfig, dict(rank=-1), "lora_rank must be >= 1, got -1", dict(lora_rank=-1)),
    (OLoraConfig, dict(lam=-1.0), "o_lora_lambda must be >= 0, got -1.0", dict(o_lora_lambda=-1.0)),
    (OLoraConfig, dict(lam=math.nan), "o_lora_lambda must be >= 0, got nan", dict(o_lora_lambda=math.nan)),
    (OLoraConfig, dict(rank=0), "lora_rank must be >= 1", dict(lora_rank=0)),
    (OsfMethodConfig, dict(effective_rank=1.5),
     "osf_effective_rank must be a fraction in (0, 1) or a whole number >= 1, got 1.5", dict(osf_effective_rank=1.5)),
    (OsfMethodConfig, dict(rank_step=2.0), "osf_rank_step must be 0 or, as osf_effective_rank 0.3 is, a fraction",
     dict(osf_rank_step=2.0)),
    (ReplayConfig, dict(fraction=0.0), "replay_fraction must be in (0, 1], got 0.0", dict(replay_fraction=0.0)),
    (ReplayConfig, dict(fraction=1.5), "replay_fraction must be in (0, 1]", dict(replay_fraction=1.5)),
    (ReplayConfig, dict(base="adept"), "replay_base must be one of full, lora, got 'adept'", dict(replay_base="adept")),
    (ReplayConfig, dict(ratio=1.0), "replay_ratio must be in [0, 1)", dict(replay_ratio=1.0)),
    (ReplayConfig, dict(select="newest"), "replay_select must be one of random, balanced, surprise",
     dict(replay_select="newest")),
    (ReplayConfig, dict(distill=-1.0), "replay_distill must be a finite number >= 0", dict(replay_distill=-1.0)),
    (ReplayConfig, dict(distill=math.inf), "replay_distill must be a finite number >= 0",
     dict(replay_distill=math.inf)),
    (ReplayConfig, dict(distill_top_k=0), "replay_distill_top_k must be >= 1", dict(replay_distill_top_k=0)),
    (ReplayConfig, dict(source="stored"), "replay_source must be one of examples, generated, none",
     dict(replay_source="stored")),
    (ReplayConfig, dict(temperature=0.0), "replay_temperature must be > 0", dict(replay_temperature=0.0)),
    (ReplayConfig, dict(ema_decay=1.0), "ema_decay must be in [0, 1)", dict(ema_decay=1.0)),
    (ReplayConfig, dict(answer_loss="focal"), "answer_loss must be one of token, label_space, keep_old_labels",
     dict(answer_loss="focal")),
    (ReplayConfig, dict(source="none", distill=1.0), "replay_distill is taken only with a buffer",
     dict(replay_source="none", replay_distill=1.0)),
    (ReplayConfig, dict(source="none", ratio=0.5), "replay_ratio is taken only with a buffer",
     dict(replay_source="none", replay_ratio=0.5)),
    (ReplayConfig, dict(base="lora", rank=0), "lora_rank must be >= 1, got 0", dict(replay_base="lora", lora_rank=0)),
    (AdeptSeqConfig, dict(k=0), "k must be >= 1", dict(k=0)),
    (AdeptSeqConfig, dict(normalize="zscore"), "normalize must be one of", dict(normalize="zscore")),
    (AdeptSeqConfig, dict(recompute_every=0), "recompute_every must be >= 1", dict(recompute_every=0)),
    (LlamaProSeqConfig, dict(k=0), "k must be >= 1", dict(k=0)),
    (DealConfig, dict(rank=0), "deal_rank must be >= 1, got 0", dict(deal_rank=0)),
    (DealConfig, dict(a=2.0, b=5.0), "deal_a >= deal_b >= 1 is needed", dict(deal_a=2.0, deal_b=5.0)),
    (EoupCTConfig, dict(proxy_len=40), "eoupct_proxy_len must be in 4..32, got 40", dict(eoupct_proxy_len=40)),
    (EoupCTConfig, dict(lam=-0.5), "eoupct_lambda must be >= 0, got -0.5", dict(eoupct_lambda=-0.5)),
]


@pytest.mark.parametrize("config_class,change,message,flat", INVALID,
                         ids=[f"{c.__name__}-{ch or fl}" for c, ch, _, fl in INVALID])
def test_every_invalid_value_is_refused_before_anything_is_created(monkeypatch, config_class, change, message, flat):
    def created(self, config):
        raise AssertionError("a method was created from an invalid config")

    monkeypatch.setattr(REGISTRY[config_class.method], "__init__", created)
    if change is not None:
        with pytest.raises(MethodError, match=re.escape(message)):
            config_class(**change)
    if flat is not None:
        options = dataclasses.replace(runner_of(config_class.method)(), **flat)
        with pytest.raises(MethodError, match=re.escape(message)):
            create(config_class.method, options, sequence=REGISTRY[config_class.method].sequence)


def test_configs_take_keywords_only():
    with pytest.raises(TypeError):
        LoraMethodConfig(4)


@pytest.mark.parametrize("config,message", [
    (AdeptConfig(k=5), "k = 5 is not in [1, 4] for a model with 4 layers"),
    (AdeptConfig(k=1, layers=[1, 4]), "--layers [4] out of range for a model with 4 layers"),
    (AdeptSeqConfig(k=5), "k = 5 is not in [1, 4] for a model with 4 layers"),
    (FreezeDeepConfig(boundary="4"), "boundary 4 is not in [1, 3] for a model with 4 layers"),
])
def test_what_depends_on_the_model_is_refused_by_check(config, message):
    method = get_method(config)
    with pytest.raises(MethodError, match=re.escape(message)):
        method.check(tiny_model("llama", layers=4))


def test_create_keeps_its_name_checks():
    with pytest.raises(MethodError, match="unknown method 'magic'"):
        create("magic", RunConfig())
    with pytest.raises(MethodError, match="method 'adept' does not learn task sequences"):
        create("adept", ContinualConfig(), sequence=True)
    with pytest.raises(MethodError, match=re.escape("method 'deal' is for task sequences (adept-ext continual)")):
        create("deal", RunConfig())


# ---------------------------------------------------------------- get_method
@pytest.mark.parametrize("name", NAMES)
def test_get_method_returns_the_registered_class_as_create_does(name):
    options = runner_of(name)()
    made = create(name, options, sequence=REGISTRY[name].sequence)
    assert type(made) is type(get_method(CONFIGS[name]())) is REGISTRY[name]
    assert made.config == CONFIGS[name].from_options(options)


@pytest.mark.parametrize("not_a_config", [RunConfig(), ContinualConfig(), MethodConfig(), LayerConfig(), "adept", None])
def test_get_method_refuses_what_is_not_a_registered_methods_config(not_a_config):
    with pytest.raises(TypeError, match="get_method needs the config of a registered method"):
        get_method(not_a_config)


def test_replay_builds_its_base_from_its_config():
    assert type(get_method(ReplayConfig()).base) is REGISTRY["seq_full"]
    base = get_method(ReplayConfig(base="lora", rank=3)).base
    assert type(base) is REGISTRY["seq_lora"] and base.config == SeqLoraConfig(rank=3)


# ---------------------------------------------------------------- the training comes from the Context
def small(name):
    """The config of `name` for a 4-layer model: k = 1 where the method takes k."""
    config_class = CONFIGS[name]
    return config_class(k=1) if "k" in {f.name for f in dataclasses.fields(config_class)} else config_class()


@pytest.mark.parametrize("name", NAMES)
def test_a_method_trains_with_the_contexts_lr_weight_decay_steps_and_seed(name):
    model = tiny_model("llama", layers=4)
    method = get_method(small(name))
    ctx = Context(padded_batches(n_batches=1), padded_batches(n_batches=1, seed=2), progress=False,
                  lr=1.5e-3, weight_decay=0.07, total_steps=7, seed=11)
    method.check(model)
    setup = method.prepare(model, ctx)
    assert setup.trainable and setup.groups
    assert all(g["lr"] == 1.5e-3 for g in setup.groups)
    decays = {g["weight_decay"] for g in setup.groups}
    assert 0.07 in decays and decays <= {0.07, 0.0}  # ADEPT's per-unit groups: no decay on norms
    optimizer = torch.optim.AdamW(setup.groups)
    method.attach(optimizer)
    if getattr(method, "decoupled", None) is not None:  # ADEPT's rates: no recompute after the last step
        assert method.decoupled.last_step == 7
    if name == "replay":
        assert method.seed == 11
    if name == "eoupct":
        assert method.total_steps == 7
    batch = padded_batches(n_batches=1)[0]
    optimizer.zero_grad(set_to_none=True)
    method.loss(model, batch).backward()  # one step and the task's end: every hook runs on the config alone
    optimizer.step()
    finished = method.end_task(model, None, {})
    assert isinstance(finished, torch.nn.Module)
