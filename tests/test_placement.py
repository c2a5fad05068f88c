"""Stage 1 placement criteria: each picks the layers it should on planted scores, each runs on a
real tiny model, and every placement's expanded model computes what the base model did."""
import pytest
import torch
from tiny_models import padded_batches, tiny_model

from adept_ext.adept import placement
from adept_ext.adept.expand import expand_layers

GENERAL = [0.9, 0.1, 0.5, 0.2, 0.8, 0.05, 0.7, 0.3]   # I_g: layers 5, 1, 3 matter least for general text
DOMAIN = [0.1, 0.05, 0.9, 0.8, 0.2, 0.01, 0.1, 0.6]   # I_d: layers 2, 3, 7 matter most for the domain


def test_importance_spread_depth_uniform_on_planted_scores():
    assert placement._lowest(GENERAL, 3) == [1, 3, 5]
    assert placement.spread(GENERAL, 2) == [1, 5]          # blocks [0, 4) and [4, 8)
    assert placement.spread(GENERAL, 4) == [1, 3, 5, 7]    # one per block of two
    assert placement.in_depth(GENERAL, 2, boundary=4) == [5, 7]
    assert placement.uniform(8, 4) == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="fewer than k"):
        placement.in_depth(GENERAL, 3, boundary=6)


def test_domain_aware_prefers_layers_the_domain_needs_and_general_text_does_not():
    # ratios I_g/I_d: 9, 2, 0.56, 0.25, 4, 5, 7, 0.5 -> layers 3, 7, 2
    assert placement.by_ratio(GENERAL, DOMAIN, 3) == [2, 3, 7]
    # a layer whose bypass helps the domain (negative I_d) is floored, never preferred
    assert 0 not in placement.by_ratio(GENERAL, [-5.0] + DOMAIN[1:], 3)


def test_plasticity_prefers_high_domain_gradient_energy_per_general_harm():
    energy = [1.0, 0.1, 5.0, 0.2, 0.1, 0.3, 4.0, 0.1]  # G/I_g: 1.1, 1, 10, 1, .125, 6, 5.7, .33
    assert placement.by_plasticity(energy, GENERAL, 3) == [2, 5, 6]


def test_output_gradient_energy_matches_autograd_and_leaves_the_model_alone():
    model = tiny_model("llama", layers=3)
    batches = padded_batches(n_batches=2)
    before = {n: p.clone() for n, p in model.named_parameters()}
    energy = placement.output_gradient_energy(model, batches)
    expected = [0.0] * 3
    for batch in batches:
        model.zero_grad()
        model(**batch).loss.backward()
        for i, layer in enumerate(model.model.layers):
            expected[i] += float(layer.self_attn.o_proj.weight.grad.double().square().sum()
                                 + layer.mlp.down_proj.weight.grad.double().square().sum())
    assert energy == pytest.approx(expected, rel=1e-6)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def _with_identity_layers(layers, seed):
    """A tiny Llama whose `layers` compute the identity (o_proj and down_proj zeroed): their
    bypass changes nothing, so their I_g is exactly 0."""
    model = tiny_model("llama", layers=6, seed=seed)
    with torch.no_grad():
        for i in layers:
            for proj in (model.model.layers[i].self_attn.o_proj, model.model.layers[i].mlp.down_proj):
                proj.weight.zero_()
    return model


def test_probe_based_placements_find_planted_identity_layers_in_a_real_model():
    model = _with_identity_layers((1, 4), seed=9)  # seed 9: every other layer's bypass raises the loss
    general = padded_batches(n_batches=2, seed=1)
    scores = placement.choose("importance", model, 2, general, progress=False)["general"].scores
    assert scores[1] == pytest.approx(0, abs=1e-6) and scores[4] == pytest.approx(0, abs=1e-6)
    assert min(s for i, s in enumerate(scores) if i not in (1, 4)) > 0.01
    assert placement.choose("importance", model, 2, general, progress=False)["layers"] == [1, 4]
    assert placement.choose("spread", model, 2, general, progress=False)["layers"] == [1, 4]  # one per half
    # from layer 3 on: the planted 4, then 3 (the least important of 3 and 5)
    assert placement.choose("depth", model, 2, general, boundary=3, progress=False)["layers"] == [3, 4]
    assert placement.choose("depth", model, 1, general, boundary=2, progress=False)["layers"] == [4]


@pytest.mark.parametrize("name", placement.PLACEMENTS)
def test_every_placement_runs_and_its_expansion_preserves_the_function(name):
    model = tiny_model("qwen3", layers=6)
    general, domain = padded_batches(n_batches=2, seed=1), padded_batches(n_batches=2, seed=7)
    result = placement.choose(name, model, 2, general, domain, boundary=3 if name == "depth" else None, progress=False)
    layers = result["layers"]
    assert len(layers) == 2 and layers == sorted(set(layers)) and all(0 <= l < 6 for l in layers)
    if name == "depth":
        assert all(l >= 3 for l in layers)
    batch = general[0]
    with torch.no_grad():
        before = model(**batch).logits
        expand_layers(model, layers)
        after = model(**batch).logits
    assert (after - before).abs().max() <= 1e-6


def test_placements_that_need_the_domain_refuse_to_run_without_it():
    model = tiny_model("llama", layers=3)
    with pytest.raises(ValueError, match="needs domain probe"):
        placement.choose("domain_aware", model, 1, padded_batches(), None, progress=False)
    with pytest.raises(ValueError, match="unknown placement"):
        placement.choose("nearest", model, 1, padded_batches(), progress=False)
