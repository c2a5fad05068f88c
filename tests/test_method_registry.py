"""A method is one file: a method defined under tmp_path, and nothing else edited, is offered by
`adept-ext continual` (flag, help, TOML key, run.json, the docs/cli.md table), gets its option, and
its option is refused with another method."""
import importlib.util
import json
import re

import pytest

from adept_ext.cli import main, options_table
from adept_ext.methods.base import REGISTRY

METHOD_FILE = '''
from dataclasses import dataclass
from typing import ClassVar

from adept_ext.methods.base import option, register
from adept_ext.methods.lora import SeqLora, SeqLoraConfig


@dataclass(kw_only=True)
class ThrowAwayConfig(SeqLoraConfig):
    method: ClassVar[str] = "throw_away"
    strength: float = option(0.25, "throw_away_strength", help="how hard the throw-away method throws")

    def __post_init__(self):
        super().__post_init__()
        self.require("strength", self.strength > 0, "must be > 0")


@register
class ThrowAway(SeqLora):
    name = "throw_away"
    config_class = ThrowAwayConfig
    description = "a method that exists for one test"
'''


@pytest.fixture
def throw_away(tmp_path):
    path = tmp_path / "throw_away.py"
    path.write_text(METHOD_FILE)
    spec = importlib.util.spec_from_file_location("throw_away", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    del REGISTRY["throw_away"]


@pytest.fixture
def recorded(monkeypatch):
    """`continual.run` replaced by one that writes the run directory's run.json (as the real one
    does first) and records the config."""
    import adept_ext.continual as continual
    from adept_ext.training import prepare_out

    configs = []

    def record(cfg, progress=True, log=print):
        configs.append(cfg)
        prepare_out(cfg, "continual")
        return {}

    monkeypatch.setattr(continual, "run", record)
    return configs


def test_a_method_in_one_file_is_offered_everywhere(throw_away, recorded, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["continual", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--throw-away-strength FLOAT throw_away: how hard the throw-away method throws (default: 0.25)" in text
    assert re.search(r"seq_lora, o_lora, [a-z_, ]*throw_away: LoRA rank", text)  # the shared option lists it too
    assert "| `--throw-away-strength` | `0.25` | throw_away: how hard the throw-away method throws |" in \
        options_table("continual")

    toml = tmp_path / "run.toml"
    toml.write_text('method = "throw_away"\nthrow_away_strength = 0.5\n')
    out = tmp_path / "out"
    assert main(["continual", "--config", str(toml), "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "run.json").read_text())["config"]["throw_away_strength"] == 0.5
    from adept_ext.methods import create

    assert create("throw_away", recorded[0], sequence=True).config.strength == 0.5

    assert main(["continual", "--method", "seq_lora", "--throw-away-strength", "2", "--out", str(tmp_path / "x"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--throw-away-strength is an option of throw_away, not of seq_lora" in err
    assert not (tmp_path / "x").exists()
    assert main(["continual", "--method", "throw_away", "--throw-away-strength", "-1", "--out", str(tmp_path / "y"),
                 "--no-progress"]) == 2
    assert "throw_away_strength must be > 0, got -1.0" in capsys.readouterr().err


def test_without_the_method_its_option_is_unknown(capsys):
    assert "throw_away" not in REGISTRY
    with pytest.raises(SystemExit):
        main(["continual", "--throw-away-strength", "2"])
    assert "unrecognized arguments: --throw-away-strength" in capsys.readouterr().err


def test_a_shared_option_names_each_methods_default_where_they_differ(throw_away):
    from dataclasses import dataclass
    from typing import ClassVar

    from adept_ext.continual import continual_config_class
    from adept_ext.methods.base import method_options, option, register
    from adept_ext.methods.lora import SeqLora

    @dataclass(kw_only=True)
    class OtherRankConfig(throw_away.ThrowAwayConfig):
        method: ClassVar[str] = "other_rank"
        rank: int = option(4, "lora_rank", help="LoRA rank")

    @register
    class OtherRank(SeqLora):
        name = "other_rank"
        config_class = OtherRankConfig

    try:
        spec = method_options(["seq_lora", "other_rank"])["lora_rank"]
        assert spec.default is None
        assert spec.help() == "seq_lora: LoRA rank (default 8); other_rank: LoRA rank (default 4)"
        cls = continual_config_class()
        assert cls(method="other_rank").lora_rank == 4 and cls(method="seq_lora").lora_rank == 8
        assert cls(method="other_rank", lora_rank=2).lora_rank == 2
    finally:
        del REGISTRY["other_rank"]


def test_a_method_option_without_help_text_is_refused(throw_away):
    from dataclasses import dataclass
    from typing import ClassVar

    from adept_ext.methods.base import method_options

    @dataclass(kw_only=True)
    class Undocumented(throw_away.ThrowAwayConfig):
        method: ClassVar[str] = "throw_away"
        secret: int = 3

    REGISTRY["throw_away"].config_class, original = Undocumented, REGISTRY["throw_away"].config_class
    try:
        with pytest.raises(ValueError, match="Undocumented.secret: a method option needs its help text"):
            method_options(["throw_away"])
    finally:
        REGISTRY["throw_away"].config_class = original


@pytest.mark.parametrize("argv,owners", [
    (["continual", "--method", "seq_lora", "--deal-rank", "4"], "deal"),
    (["continual", "--method", "o_lora", "--eoupct-no-virtual"], "eoupct"),
    (["run", "--method", "lora", "--normalize", "global"], "adept, adept_no_expand"),
])
def test_another_methods_option_is_one_error_line_and_nothing_is_written(argv, owners, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    flag = next(a for a in argv[3:] if a.startswith("--"))
    assert err == [f"adept-ext: error: {flag} is an option of {owners}, not of {argv[2]}: choose "
                   f"{'it' if ',' not in owners else 'one of them'} with --method, or drop the option"]
    assert not out.exists()
