"""The design's import rules, checked by parsing every module under adept_ext/ with `ast` (nothing is imported).

Layers, lowest first; a module may import its own layer and the layers below it, never one above:

    0 kernels      ops, reference, _C, _cuda_arch, _build_info
    1 mechanisms   models/ (families, loading, held, quantize), lm_loss, adept/ (probe, placement, expand, units,
                   lr), optim, projection, lens/ (diagnosis, inputs), parallel, report, data/, errors,
                   evaluation/ (harness, lm_eval_tasks, general_suite, answers, paired), merge_back
    2 methods      adept_ext/methods/
    3 training     adept_ext/training/
    4 runners      train.py, continual.py, hf.py (the Trainer integration of methods and mechanisms)
    5 interface    cli.py, __main__.py, and the package's public face adept_ext/__init__.py (it re-exports
                   from any layer, so no adept_ext module may import a name from it)

So no mechanism or data module imports methods, training, train, continual or cli; no method imports
training, train, continual or cli; training imports no runner and not the CLI. Function-level (lazy)
imports count as much as module-level ones. Besides the layers: no import cycle among adept_ext modules
(nor among its top-level packages), and no private name (a leading underscore) imported from another
adept_ext module, except the compiled-extension modules in ALLOWED_PRIVATE.

Each check lists every violation with file, line and whether the import is at module level or inside a
function.
"""
import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "adept_ext"

KERNELS, MECHANISMS, METHODS, TRAINING, RUNNERS, INTERFACE = range(6)
LAYER_NAMES = ["kernels", "mechanisms", "methods", "training", "runners", "interface"]
# Top-level names under adept_ext (a module, or a package with everything in it) and their layer.
LAYERS = {
    **dict.fromkeys(("ops", "reference", "_C", "_cuda_arch", "_build_info"), KERNELS),
    **dict.fromkeys(("models", "lm_loss", "adept", "optim", "projection", "lens", "parallel", "report", "data",
                     "errors", "evaluation", "merge_back"),
                    MECHANISMS),
    "methods": METHODS,
    "training": TRAINING,
    **dict.fromkeys(("train", "continual", "hf"), RUNNERS),
    **dict.fromkeys(("cli", "__main__"), INTERFACE),
}
ROOT = "adept_ext"
LAYERS_OF_ROOT = INTERFACE  # adept_ext/__init__.py
# Modules that are no .py file in the tree: the compiled extension, and the build record setup.py writes.
NON_SOURCE_MODULES = {"adept_ext._C", "adept_ext._build_info"}
# Private names another adept_ext module may import: the compiled extension and its build records.
ALLOWED_PRIVATE = {"_C", "_cuda_arch", "_build_info"}


@dataclass(frozen=True)
class Import:
    importer: str            # dotted module name
    target: str              # the adept_ext module it imports (or imports names from)
    names: tuple             # the names taken from `target` (empty for `import x` and for a submodule itself)
    path: str                # file, relative to the repository
    line: int
    function: Optional[str]  # enclosing function, None at module level (a class body runs at import: module level)

    def where(self) -> str:
        return f"{self.path}:{self.line} ({'module level' if self.function is None else f'in {self.function}()'})"


def module_names(package_dir: Path) -> Dict[str, Path]:
    """Dotted name -> file of every module under `package_dir` (its folder name is the package name)."""
    root = package_dir.name
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([root, *parts])] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


class _Collector(ast.NodeVisitor):
    def __init__(self):
        self.found = []  # (node, enclosing function or None)
        self.function = []

    def _function(self, node):
        self.function.append(node.name)
        self.generic_visit(node)
        self.function.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node):
        self.function.append("<lambda>")
        self.generic_visit(node)
        self.function.pop()

    def visit_Import(self, node):
        self.found.append((node, ".".join(self.function) or None))

    visit_ImportFrom = visit_Import


def imports(package_dir: Path = PACKAGE_DIR) -> List[Import]:
    """Every import of an adept_ext module by an adept_ext module (module-level and inside functions)."""
    modules = module_names(package_dir)
    root = package_dir.name
    known = set(modules) | {root + n[len("adept_ext"):] for n in NON_SOURCE_MODULES}
    repo = package_dir.parent
    result = []
    for name, path in modules.items():
        collector = _Collector()
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        here = name.split(".") if _is_package(path) else name.split(".")[:-1]  # the importer's package
        for node, function in collector.found:
            rel = str(path.relative_to(repo))
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == root or alias.name.startswith(root + "."):
                        result.append(Import(name, alias.name, (), rel, node.lineno, function))
                continue
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not (source == root or source.startswith(root + ".")):
                continue  # a third-party or standard-library import
            taken = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:  # `from . import data`: the submodule itself
                    result.append(Import(name, sub, (), rel, node.lineno, function))
                else:
                    taken.append(alias.name)
            if taken or not node.names:
                result.append(Import(name, source, tuple(taken), rel, node.lineno, function))
    return result


def top(module: str) -> str:
    """The top-level name under the package (`adept_ext.methods.adept` -> `methods`); the root for its __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def layer_of(module: str) -> Optional[int]:
    name = top(module)
    return LAYERS_OF_ROOT if name == ROOT else LAYERS.get(name)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ---------------------------------------------------------------- the checks (lists of violations)

def unlayered_modules(package_dir: Path = PACKAGE_DIR) -> List[str]:
    return [f"{m} ({p.relative_to(package_dir.parent)}) is in no layer: add it to LAYERS in tests/test_import_rules.py"
            for m, p in module_names(package_dir).items() if layer_of(m) is None]


def upward_imports(found: List[Import]) -> List[str]:
    out = []
    for i in found:
        a, b = layer_of(i.importer), layer_of(i.target)
        if a is not None and b is not None and b > a:
            what = f" ({', '.join(i.names)})" if i.names else ""
            out.append(f"{i.where()}: {i.importer} [{LAYER_NAMES[a]}] imports {i.target}{what} [{LAYER_NAMES[b]}]")
    return out


def _strongly_connected(nodes: Set[str], edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components with more than one node, each sorted, in sorted order."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(comps)


def _shortest_cycle(comp: List[str], edges: Dict[str, Set[str]]) -> List[str]:
    """The shortest cycle inside a strongly connected `comp` (breadth-first from each member, the first
    found in sorted order among the shortest): its nodes in order, the last one importing the first."""
    best = None
    for start in comp:
        prev, queue, last = {start: None}, [start], None
        while queue and last is None:
            v = queue.pop(0)
            for w in sorted(edges.get(v, ())):
                if w == start:
                    last = v
                    break
                if w in comp and w not in prev:
                    prev[w] = v
                    queue.append(w)
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        if best is None or len(path) < len(best):
            best = path[::-1]
    return best


def _cycles(found: List[Import], key) -> List[tuple]:
    """(members, shortest cycle as [(importer, target, [imports])]) of every cycle of the import graph
    whose nodes are `key(module)`."""
    edges: Dict[str, Set[str]] = {}
    sites: Dict[tuple, List[Import]] = {}
    for i in found:
        a, b = key(i.importer), key(i.target)
        if a != b:
            edges.setdefault(a, set()).add(b)
            sites.setdefault((a, b), []).append(i)
    nodes = set(edges) | {b for bs in edges.values() for b in bs}
    result = []
    for comp in _strongly_connected(nodes, edges):
        cycle = _shortest_cycle(comp, edges)
        pairs = list(zip(cycle, cycle[1:] + cycle[:1]))
        result.append((comp, [(a, b, sites[a, b]) for a, b in pairs]))
    return result


def import_cycles(found: List[Import]) -> List[str]:
    """Cycles among modules, then cycles among top-level packages that are not just a module cycle:
    the members, and the imports of the shortest cycle among them (module level or inside a function)."""
    modules = _cycles(found, lambda m: m)
    packages = [(comp, cycle) for comp, cycle in _cycles(found, top)
                if not any(sorted({top(m) for m in c}) == comp for c, _ in modules)]
    return [f"import cycle among {label} {' <-> '.join(comp)}: " +
            "; ".join(f"{a} -> {b} at {', '.join(i.where() for i in imps)}" for a, b, imps in cycle)
            for label, cycles in (("modules", modules), ("top-level packages", packages)) for comp, cycle in cycles]


def private_imports(found: List[Import]) -> List[str]:
    out = []
    for i in found:
        module_parts = i.target.split(".")[1:]
        bad = [p for p in module_parts if _private(p) and p not in ALLOWED_PRIVATE]
        bad += [n for n in i.names if _private(n) and n not in ALLOWED_PRIVATE]
        if bad:
            out.append(f"{i.where()}: {i.importer} imports private {', '.join(bad)} from {i.target}")
    return out


def _report(violations: List[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(violations)


def test_every_module_is_in_a_layer():
    found = module_names(PACKAGE_DIR)
    assert len(found) > 30 and "adept_ext.cli" in found and "adept_ext.methods.base" in found
    violations = unlayered_modules()
    assert not violations, _report(violations)


def test_no_module_imports_a_higher_layer():
    violations = upward_imports(imports())
    assert not violations, _report(violations)


def test_no_import_cycles():
    violations = import_cycles(imports())
    assert not violations, _report(violations)


def test_no_private_name_is_imported_from_another_module():
    violations = private_imports(imports())
    assert not violations, _report(violations)


def test_the_parser_sees_the_imports_it_must_check():
    """Guards the checks above against passing because the parser found nothing: known imports of
    each kind (relative, submodule, inside a function, two levels up) are found as such."""
    found = {(i.importer, i.target, i.names, i.function) for i in imports()}
    assert ("adept_ext.__main__", "adept_ext.cli", ("main",), None) in found
    assert ("adept_ext.methods.adept", "adept_ext.adept.placement", (), None) in found  # from ..adept import placement
    assert ("adept_ext.ops.checks", "adept_ext._build_info", ("CUDA_ARCH_LIST",), "compiled_cuda_arch_list") in found
    assert ("adept_ext", "adept_ext._C", (), None) in found  # allowed: from . import _C
    kernels_and_root = [i for i in imports() if i.importer == "adept_ext" or i.importer.startswith("adept_ext.ops")]
    assert not private_imports(kernels_and_root)


PLANTED = {  # a tiny package with one violation of every rule, and imports that are allowed
    "__init__.py": "from . import _C\nfrom .ops import kernel\n",
    "_cuda_arch.py": "",
    "ops.py": "from . import _cuda_arch\n\ndef kernel():\n    from ._build_info import CUDA_ARCH_LIST\n",
    "projection.py": "from .ops import kernel\n",
    "data.py": "import os\nfrom .projection import x\n\ndef blocks():\n    from .lm_loss import packed\n",
    "lm_loss.py": "from . import data\n",
    "optim.py": "from .methods.base import Method\n",                     # mechanism -> methods
    "methods/__init__.py": "from .base import Method\n",
    "methods/base.py": "from ..projection import x\n\nclass Method:\n    from ..training.loop import steps\n",
    "training/__init__.py": "",
    "training/loop.py": "import adept_ext.hf\n",                       # training -> runner
    "hf.py": "",
    "train.py": "from .training.loop import steps\n\ndef _device():\n    pass\n",
    "cli.py": "def main():\n    from .train import _device\n",      # private, inside a function
    "report.py": "from . import kernel\n",                           # a name from the package's public face
    "helper.py": "",                                                  # in no layer
}


def test_the_checks_report_planted_violations(tmp_path):
    package = tmp_path / "adept_ext"
    for rel, text in PLANTED.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    found = imports(package)
    assert unlayered_modules(package) == [
        "adept_ext.helper (adept_ext/helper.py) is in no layer: add it to LAYERS in tests/test_import_rules.py"]
    assert upward_imports(found) == [
        "adept_ext/methods/base.py:4 (module level): adept_ext.methods.base [methods] imports adept_ext.training.loop "
        "(steps) [training]",
        "adept_ext/optim.py:1 (module level): adept_ext.optim [mechanisms] imports adept_ext.methods.base (Method) "
        "[methods]",
        "adept_ext/report.py:1 (module level): adept_ext.report [mechanisms] imports adept_ext (kernel) [interface]",
        "adept_ext/training/loop.py:1 (module level): adept_ext.training.loop [training] imports adept_ext.hf "
        "[runners]"]
    assert import_cycles(found) == [
        "import cycle among modules adept_ext.data <-> adept_ext.lm_loss: adept_ext.data -> "
        "adept_ext.lm_loss at adept_ext/data.py:5 (in blocks()); adept_ext.lm_loss -> adept_ext.data at "
        "adept_ext/lm_loss.py:1 (module level)"]
    assert private_imports(found) == [
        "adept_ext/cli.py:2 (in main()): adept_ext.cli imports private _device from adept_ext.train"]
    # a cycle between packages that is no cycle between modules: methods.base -> units, units -> methods.other
    (package / "projection.py").write_text("from .ops import kernel\nfrom .methods import base\n")
    cycles = import_cycles(imports(package))
    assert any(c.startswith("import cycle among modules adept_ext.methods.base <-> adept_ext.projection")
               for c in cycles)
    (package / "projection.py").write_text("from .ops import kernel\nfrom .methods.other import y\n")
    (package / "methods" / "other.py").write_text("")
    cycles = import_cycles(imports(package))
    assert any(c.startswith("import cycle among top-level packages methods <-> projection") for c in cycles), cycles


TORCH_INTERNALS = PACKAGE_DIR / "ops" / "torch_internals.py"


def private_torch_uses(package_dir: Path = PACKAGE_DIR, allowed: Path = TORCH_INTERNALS) -> List[str]:
    """"file:line" of every `torch.<...>._name` attribute and every import of a private torch module
    or name outside `allowed` (`torch._foreach_*`, documented ops, excepted)."""
    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__") and not part.startswith("_foreach_")

    found = set()
    for path in sorted(package_dir.rglob("*.py")):
        if path == allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            parts = []
            if isinstance(node, ast.Attribute):
                inner = node
                while isinstance(inner, ast.Attribute):
                    parts.append(inner.attr)
                    inner = inner.value
                parts = parts if isinstance(inner, ast.Name) and inner.id == "torch" else []
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                parts = node.module.split(".") + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                parts = [p for a in node.names if a.name.split(".")[0] == "torch" for p in a.name.split(".")]
            if any(private(p) for p in parts):
                found.add(f"{path.relative_to(package_dir.parent)}:{node.lineno}")
    return sorted(found)


def test_private_torch_apis_are_used_in_one_place():
    """Every private torch API is in ops/torch_internals.py, with the versions it was checked on."""
    assert not private_torch_uses(), "\n".join(private_torch_uses())
    assert "Checked on:" in TORCH_INTERNALS.read_text()


def test_the_private_torch_check_sees_a_planted_use(tmp_path):
    package = tmp_path / "adept_ext"
    package.mkdir()
    (package / "a.py").write_text("import torch\n\ndef f(m):\n    return torch._C._any_requires_grad(m)\n")
    (package / "b.py").write_text("from torch.distributed._composable_state import _module_state_mapping\n")
    (package / "c.py").write_text("import torch\ntorch._foreach_add_([], 1)\n")
    got = private_torch_uses(package, package / "none.py")
    assert any("a.py:4" in g for g in got) and any("b.py:1" in g for g in got) and not any("c.py" in g for g in got)


def prints(root: Path):
    """(file, line) of every call of print() in the package outside the command's error line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" and not (
                    path.name == "cli.py" and any(k.arg == "file" for k in node.keywords)):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_the_library_logs_through_logging(tmp_path):
    """Messages go through `logging` (the `adept_ext` loggers; the command shows them): no print() in the
    package but the command's one error line, and no `print` as a default logger."""
    root = Path(__file__).resolve().parents[1] / "adept_ext"
    assert prints(root) == []
    defaults = [f"{p.relative_to(root.parent)}" for p in root.rglob("*.py") if "= print" in p.read_text()]
    assert defaults == []
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f(log=print):\n    print('x')\n")
    assert prints(tmp_path / "pkg") == ["pkg/m.py:2"]
