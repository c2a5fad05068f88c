"""A runner's config as composed from the option declarations, and read from them: its fields (the
runner's own options and the registered methods' options, `with_method_options`), the properties
each declaration gives an option (`marked`, `not_results`, `other_names`; `methods.base.option`),
its resolved results-determining options (`result_options`) and the checks of given values against
the declarations (`check_types`, `foreign_options`, `current_names`)."""
import types
import typing
from dataclasses import field, fields, make_dataclass
from typing import Collection, Dict, List, Optional

from ..errors import RunError
from ..methods import method_names
from ..methods.base import REGISTRY, method_options

_COMPOSED: Dict[tuple, type] = {}


def marked(cls, prop: str) -> List[str]:
    """The options of `cls` (a runner's config) whose declaration sets `prop` (`option(..., resumable=True)`,
    `one_way`, `commands`, ...: `methods.base.option`), in field order."""
    return [f.name for f in fields(cls) if f.metadata.get(prop)]


def not_results(cls) -> List[str]:
    """The options of `cls` that never change what a run computes (`affects_results=False`: where it
    writes, how often it checkpoints or logs, what it tracks, how many processes prepare its data,
    what it measures beside the held-out losses)."""
    return [f.name for f in fields(cls) if f.metadata.get("affects_results", True) is False]


def other_names(cls, prop: str) -> Dict[str, str]:
    """{other name: option} of `cls` for `prop` `former_names` (flags, TOML keys, older run.json keys
    that still name an option) or `known_as` (other tools' names, suggested for an unknown option)."""
    return {other: f.name for f in fields(cls) for other in f.metadata.get(prop, ())}


def result_options(cfg) -> Dict:
    """The resolved options that determine a run's results: every option of `cfg` (a runner's config,
    `with_method_options`) with its value, less `not_results` and the options only other methods than
    `cfg.method` take. The comparison tools reuse a recorded run only where these are equal."""
    left_out = not_results(type(cfg))
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)
            if f.name not in left_out
            and (f.metadata.get("methods") is None or cfg.method in f.metadata["methods"].defaults)}


def typed_options(defaults, texts: Dict[str, str]) -> Dict:
    """Options given as text (`OPTION=VALUE`, as the comparison tools' `--set` gives them) converted to
    the type of each option's value in `defaults` (a runner's config); a bool reads 1, true, yes, on."""
    typed = {}
    for key, value in texts.items():
        kind = type(getattr(defaults, key))
        typed[key] = value.lower() in ("1", "true", "yes", "on") if kind is bool else kind(value)
    return typed


def with_method_options(base: type, sequence: bool = False) -> type:
    """The config of a runner: its own options (`base`, a TrainOptions subclass) followed by one
    field per option of the registered methods it runs (`methods.method_options`; single-domain
    methods, or sequence methods when `sequence`), named as the flat option, with its default
    (None where the methods disagree: then the chosen method's, filled in when the config is
    built). Built again when the registry has grown, so a method added later is offered too."""
    names = method_names(sequence=True) if sequence else method_names(single_domain=True)
    key = (base, tuple((name, REGISTRY[name].config_class) for name in names))
    if key not in _COMPOSED:
        specs = method_options(names, {f.name for f in fields(base)})
        extra = [(s.name, s.type if s.default is not None else Optional[s.type],
                  field(default=s.default, metadata={"help": s.help(), "methods": s, **s.properties}))
                 for s in specs.values()]
        _COMPOSED[key] = make_dataclass(base.__name__.replace("Options", "Config"), extra, bases=(base,),
                                        namespace={"__post_init__": _method_defaults, "__module__": base.__module__,
                                                   "__doc__": base.__doc__})
    return _COMPOSED[key]


def _method_defaults(cfg):
    """Fill a method option whose methods disagree on its default with the chosen method's (or, when
    the chosen method does not take it, the first method's)."""
    for f in fields(cfg):
        spec = f.metadata.get("methods")
        if spec is not None and spec.default is None and getattr(cfg, f.name) is None:
            defaults = spec.defaults
            setattr(cfg, f.name, defaults.get(cfg.method, next(iter(defaults.values()))))


def foreign_options(cls, method: str, given: Collection[str]):
    """RunError for an option the user gave (`given`: flags, TOML keys) that belongs to other methods
    than `method` and is not a runner's own."""
    for f in fields(cls):
        spec = f.metadata.get("methods")
        if f.name in given and spec is not None and method not in spec.defaults:
            owners = list(spec.defaults)
            raise RunError(f"--{f.name.replace('_', '-')} is an option of {', '.join(owners)}, not of {method}: "
                           f"choose {'it' if len(owners) == 1 else 'one of them'} with --method, or drop the option")


def current_names(options: Dict, cls: type) -> Dict:
    """`options` with a former option name of `cls` (a runner's options; `former_names`: a flag, TOML
    key or an older run.json's key) replaced by the option's name now; RunError when both are given."""
    options = dict(options)
    for old, new in other_names(cls, "former_names").items():
        if old in options:
            if new in options:
                raise RunError(f"{old} and {new} are one option ({old} is its former name): give one of them")
            options[new] = options.pop(old)
    return options


def check_types(cls, overrides: Dict):
    """RunError for a value of the wrong type (a TOML `lr = "1e-4"`, `steps = 2.5`): an int is
    accepted for a float option, a bool is never a number."""
    hints = typing.get_type_hints(cls)
    for name, value in overrides.items():
        want = hints[name]
        allowed = typing.get_args(want) if typing.get_origin(want) in (typing.Union, types.UnionType) else (want,)
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not any(value is None if a is type(None) else
                   (numeric and a in (int, float) and (a is float or isinstance(value, int)))
                   or (a not in (int, float) and isinstance(value, a)) for a in allowed):
            names = " or ".join("none" if a is type(None) else a.__name__ for a in allowed)
            raise RunError(f"{name} must be of type {names}, got {value!r} ({type(value).__name__})")
