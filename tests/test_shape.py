"""The package keeps the shape STYLE.md describes, read from the source (ast): nothing is
imported and no process is started, so this runs in well under a second.

The import layers, the circles between folders and modules, and the offline commands' no-torch
rule are import-linter contracts in pyproject.toml ([tool.importlinter]), checked by `make lint`.
What a contract cannot say is checked here:

- every module of the package sits in one layer of that contract, and no package's __init__ is in a
  circle with a module under it (the contract sees the modules under a package, not its __init__);
- a package module is imported by an import statement, which the contracts read;
- a backend's library (wandb, mlflow, comet_ml, TensorBoard's SummaryWriter, tensorboardX) is
  named only in its own writer module under nemo_memlog/writers/;
- no torch.distributed collective outside the nemo_memlog/reduce/ package, and none of
  torch.distributed in its pure protocol module (nemo_memlog/reduce/protocol.py);
- no module uses another module's private name;
- the memory parts are listed only in parts.py, per-process state stays in a handful of named
  registries, no module is longer than a sitting, and public functions are annotated;
- what docs/architecture.md says that can be read: the layers, every module named, the registries
  (exactly those counted), which ways in call a monitor's ``log`` and which ask ``logs_at``
  themselves; and each package's docstring names the modules in its folder.

Every module of the package is read, nemo_memlog/testing/ included: the helpers that tests and
scripts share are code too, and a private name there decays the same way. Only the
collective rule exempts them: they build the test clusters and time the field's reductions.
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "nemo_memlog"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

#: A backend's library -> the modules allowed to name it. The offline report's event reader
#: (offline/events.py) also reads the TensorBoard event files the tensorboard writer wrote, with
#: tensorboard's own reader (EventAccumulator): it reads them, it writes nothing, so it is not
#: a second writer.
BACKEND_LIBRARIES = {
    "wandb": {"writers/wandb.py"},
    "mlflow": {"writers/mlflow.py"},
    "comet_ml": {"writers/comet.py"},
    "tensorboardX": {"writers/tensorboard.py"},
    "SummaryWriter": {"writers/tensorboard.py"},
    "tensorboard": {"writers/tensorboard.py", "offline/events.py"},
    "opentelemetry": {"writers/otel.py"},
    "prometheus_client": {"writers/otel.py"},
}
#: Names that mean the library wherever they stand. "wandb", "mlflow" and "tensorboard" alone
#: are also the names of our own writer modules and registry keys, so for those only an import
#: of the library (static, or by a dotted string such as "wandb.sdk") counts.
UNAMBIGUOUS = {"comet_ml", "tensorboardX", "SummaryWriter", "opentelemetry", "prometheus_client"}
DYNAMIC_IMPORTS = {"import_module", "__import__", "find_spec"}

#: torch.distributed's collectives, point-to-point calls and group builders, by the start of their
#: names, so that variants (all_gather_single, broadcast_object_list, ...) count too.
COLLECTIVE_PREFIXES = (
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
    "reduce_scatter",
    "_all_gather",
    "_reduce_scatter",
    "new_group",
    "new_subgroups",
    "split_group",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
COLLECTIVES_EXACT = {"reduce", "P2POp"}
COLLECTIVES_ALLOWED = ("reduce/", "testing/")
#: The reduce package's pure module: the key agreement, decided from words every rank received alike.
PURE_PROTOCOL = "reduce/protocol.py"


@dataclass(frozen=True)
class Module:
    name: str  # dotted: nemo_memlog.writers.wandb
    relative: str  # under the package: writers/wandb.py
    tree: ast.Module
    is_package: bool

    def where(self, node: ast.AST) -> str:
        return f"{PACKAGE}/{self.relative}:{node.lineno}"


@dataclass(frozen=True)
class Import:
    """One imported module, as written in ``module``: ``target`` is absolute and dotted."""

    target: str
    names: tuple[str, ...]  # from-import names; () for ``import target``
    node: ast.AST


@functools.cache
def modules() -> dict[str, Module]:
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        parts = [PACKAGE, *relative[: -len(".py")].split("/")]
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        found[name] = Module(name, relative, ast.parse(path.read_text(), str(path)), is_package)
    return found


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def imports(name: str) -> tuple[Import, ...]:
    """Every import in module ``name``, at any depth, with string-literal import_module calls."""
    module = modules()[name]
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(Import(_absolute(module, node), tuple(a.name for a in node.names), node))
        elif isinstance(node, ast.Call) and _called_name(node) in DYNAMIC_IMPORTS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append(Import(first.value, (), node))
    return tuple(found)


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def package_targets(imported: Import) -> list[str]:
    """The package modules an import names: ``from .x import y`` is x.y where y is a module,
    else x; ``import nemo_memlog.x`` is nemo_memlog.x. Outside the package: none. The parent
    packages' __init__, which Python runs first, are not counted: every package would then be
    in a circle with the submodules it imports."""
    known = modules()
    if imported.names:
        targets = {
            f"{imported.target}.{n}" if f"{imported.target}.{n}" in known else imported.target for n in imported.names
        }
    else:
        targets = {imported.target}
    return sorted(t for t in targets if t in known)


def _bound_modules(module: Module) -> dict[str, str]:
    """Local name -> the dotted module it is bound to by an import (package or not)."""
    known = modules()
    bound = {}
    for imported in imports(module.name):
        node = imported.node
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                dotted = f"{imported.target}.{alias.name}"
                if dotted in known or not imported.target.startswith(PACKAGE):
                    bound[alias.asname or alias.name] = dotted
    return bound


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """``a.b.c`` with ``a`` bound to a module: that module's dotted path plus ``.b.c``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(parts)])
    return None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_public_names_are_written_out_and_all_load():
    """``__all__`` is a literal list (a type checker reads it), equal to what loads lazily, and each
    name the ``TYPE_CHECKING`` block imports for type checkers is the one that loads."""
    import nemo_memlog

    init = modules()[PACKAGE].tree
    (listed,) = [n.value for n in init.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"]
    assert isinstance(listed, ast.List) and sorted(ast.literal_eval(listed)) == sorted(nemo_memlog._EXPORTS)
    checked = {a.asname or a.name for n in ast.walk(init) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert set(nemo_memlog.__all__) <= checked | {"annotations"}, set(nemo_memlog.__all__) - checked
    assert all(getattr(nemo_memlog, name) is not None for name in nemo_memlog.__all__)


def test_no_script_or_package_module_imports_the_tests():
    """Scripts and tests share helpers through nemo_memlog.testing only: never ``import tests``."""
    root = PACKAGE_DIR.parent
    offenders = []
    for path in [*PACKAGE_DIR.rglob("*.py"), *(root / "scripts").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------
# (a) the import contracts (pyproject.toml [tool.importlinter]): what they cannot say


@functools.cache
def contract_layers() -> tuple[tuple[str, ...], ...]:
    """The layers contract's layers, bottom to top, each by its modules under the package (a name
    covers a package and all below it): pyproject.toml holds the one list."""
    config = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    assert contract["containers"] == [PACKAGE], contract["containers"]
    return tuple(tuple(m.strip() for m in re.split(r"[:|]", layer)) for layer in reversed(contract["layers"]))


def test_every_module_sits_in_one_layer_of_the_contract():
    """A new module is placed in the layers contract (and docs/architecture.md) before it lands; the
    package's own __init__ is the entry points' (the contract that protects it says who imports it)."""
    misplaced = []
    for name in modules():
        if name != PACKAGE:
            top = name.split(".")[1]
            found = [members for members in contract_layers() if top in members]
            if len(found) != 1:
                misplaced.append(f"  {name}: in {len(found)} layers")
    assert not misplaced, "place each in exactly one layer of pyproject's layers contract:\n" + "\n".join(misplaced)


def test_no_package_is_in_a_circle_with_a_module_under_it():
    """The acyclic_siblings contract sees the modules and folders under each package, squashed, not
    the package's own __init__: a module that imports its package (or one above) while that package's
    __init__ reaches it is a circle only this test sees (TYPE_CHECKING imports count, as there)."""
    import grimp  # import-linter's graph: it reads the source and imports nothing

    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    circles = [
        f"  {importer} -> {package} -> ... -> {importer}"
        for package in sorted(graph.modules)
        for importer in sorted(graph.find_modules_that_directly_import(package))
        if importer.startswith(package + ".") and graph.chain_exists(importer=package, imported=importer)
    ]
    assert not circles, "a package's __init__ in a circle with a module under it:\n" + "\n".join(circles)


def test_a_package_module_is_imported_by_an_import_statement():
    """The contracts read import statements: a package module loaded by a written-out name
    (``importlib.import_module("nemo_memlog.x")``) is one they cannot see."""
    by_name = [
        f"  {module.where(imported.node)}: {imported.target}"
        for name, module in modules().items()
        for imported in imports(name)
        if isinstance(imported.node, ast.Call) and (imported.target + ".").startswith(PACKAGE + ".")
    ]
    assert not by_name, "import these with an import statement:\n" + "\n".join(by_name)


def test_the_layers_are_written_in_the_architecture_page():
    """docs/architecture.md lists the contract's layers, bottom to top, each with its modules."""
    page = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    section = page.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [" ".join(item.split()) for item in re.split(r"\n(?=\d+\. )", section) if re.match(r"\d+\. ", item)]
    assert len(rows) == len(contract_layers()), rows
    for row, members in zip(rows, contract_layers()):
        for member in members:
            assert f"`{member}" in row, (row, member)


def _part_keys() -> frozenset[str]:
    """Every part's key, and the names the outside part goes by, read from parts.py's source."""
    tree = modules()[f"{PACKAGE}.parts"].tree
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Part" and node.args:
            keys.add(ast.literal_eval(node.args[0]))
        elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "OUTSIDE_KEYS":
            keys.update(ast.literal_eval(node.value))
    return frozenset(keys)


def test_the_memory_parts_are_listed_only_in_parts_py():
    """A collection written out with two or more part keys (a tuple, list, set, or a dict's keys)
    outside parts.py is a second definition of the parts: build it from parts.py instead."""
    keys = _part_keys()
    assert {"params_gb", "temporaries_gb", "outside_gb", "device_other_gb"} <= keys, keys
    problems = []
    for module in modules().values():
        if module.relative == "parts.py":
            continue
        for node in ast.walk(module.tree):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or items is None:
                continue
            named = {item.value for item in items if isinstance(item, ast.Constant) and item.value in keys}
            if len(named) >= 2:
                problems.append(f"  {module.where(node)}: {sorted(named)}")
    assert not problems, "memory parts listed outside nemo_memlog/parts.py:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------------
# (b) a backend's library only in its own writer module


def _library_of(dotted: str) -> str | None:
    if dotted.startswith(PACKAGE + ".") or dotted == PACKAGE:
        return None
    return next((part for part in dotted.split(".") if part in BACKEND_LIBRARIES), None)


def _backend_uses(module: Module) -> list[tuple[str, ast.AST]]:
    uses = []
    for imported in imports(module.name):
        library = _library_of(imported.target)
        library = library or next(
            (n for n in imported.names if n in BACKEND_LIBRARIES and not imported.target.startswith(PACKAGE)), None
        )
        if library:
            uses.append((library, imported.node))
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Name) and node.id in UNAMBIGUOUS:
            uses.append((node.id, node))
        elif isinstance(node, ast.Attribute) and node.attr in UNAMBIGUOUS:
            uses.append((node.attr, node))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            library = text if text in UNAMBIGUOUS else _library_of(text) if "." in text and " " not in text else None
            if library and (text in UNAMBIGUOUS or text.split(".")[0] == library):
                uses.append((library, node))
    return uses


def test_a_backend_library_is_named_only_in_its_own_writer_module():
    problems = []
    for module in modules().values():
        for library, node in _backend_uses(module):
            if module.relative not in BACKEND_LIBRARIES[library]:
                problems.append(
                    f"  {module.where(node)}: {library} (belongs in {' or '.join(sorted(BACKEND_LIBRARIES[library]))})"
                )
    assert not problems, "a backend's library named outside its writer module:\n" + "\n".join(sorted(set(problems)))


# ------------------------------------------------------------------------------------------
# (c) no collective outside the reduce package; none of torch.distributed in its protocol


def _is_collective(name) -> bool:
    return isinstance(name, str) and (name in COLLECTIVES_EXACT or name.startswith(COLLECTIVE_PREFIXES))


def _collective_calls(module: Module) -> list[tuple[str, ast.AST]]:
    bound = _bound_modules(module)
    found = []
    for imported in imports(module.name):
        if imported.target.startswith("torch.distributed"):
            found += [(name, imported.node) for name in imported.names if _is_collective(name)]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute) and _is_collective(node.attr):
            dotted = _dotted(node.value, bound)
            if dotted and dotted.startswith("torch.distributed"):
                found.append((node.attr, node))
        elif isinstance(node, ast.Call) and _called_name(node) in ("getattr", "hasattr") and len(node.args) >= 2:
            owner, attribute = node.args[0], node.args[1]
            if (
                isinstance(attribute, ast.Constant)
                and _is_collective(attribute.value)
                and (_dotted(owner, bound) or "").startswith("torch.distributed")
            ):
                found.append((attribute.value, node))
    return found


def test_no_collective_outside_reduce():
    problems = []
    for module in modules().values():
        if module.relative.startswith(COLLECTIVES_ALLOWED):
            continue
        problems += [f"  {module.where(node)}: torch.distributed.{name}" for name, node in _collective_calls(module)]
    assert not problems, "collectives outside nemo_memlog/reduce/:\n" + "\n".join(sorted(set(problems)))


def test_the_reduce_protocol_never_imports_torch_distributed():
    """reduce/protocol.py, and the package modules it imports (at any depth, inside functions
    too), never import torch.distributed nor name it: the key agreement is pure."""
    (start,) = [name for name, module in modules().items() if module.relative == PURE_PROTOCOL]
    problems, seen, queue = [], set(), [start]
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        module = modules()[name]
        for imported in imports(name):
            named = [imported.target, *(f"{imported.target}.{n}" for n in imported.names)]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in named):
                problems.append(f"  {module.where(imported.node)}: imports {imported.target}")
            queue += package_targets(imported)
        bound = _bound_modules(module)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and (_dotted(node, bound) or "").startswith("torch.distributed"):
                problems.append(f"  {module.where(node)}: {_dotted(node, bound)}")
    assert not problems, f"torch.distributed in {PACKAGE}/{PURE_PROTOCOL}:\n" + "\n".join(sorted(set(problems)))


# ------------------------------------------------------------------------------------------
# (d) no private name across modules


@functools.cache
def _defined_private_names(name: str) -> frozenset[str]:
    """The private names module ``name`` defines: functions, classes, assignments, and
    attributes it sets (``self._x = ...``)."""
    defined = set()
    for node in ast.walk(modules()[name].tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return frozenset(n for n in defined if _is_private(n))


def _private_uses(module: Module) -> list[str]:
    known, bound = modules(), _bound_modules(module)
    package_aliases = {local for local, dotted in bound.items() if dotted in known}
    own = _defined_private_names(module.name)
    elsewhere = set().union(*(_defined_private_names(n) for n in known if n != module.name)) - own
    found = []
    for imported in imports(module.name):
        if isinstance(imported.node, ast.ImportFrom) and imported.target in known:
            found += [
                f"{module.where(imported.node)}: from {imported.target} import {n}"
                for n in imported.names
                if _is_private(n) and f"{imported.target}.{n}" not in known
            ]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            dotted = _dotted(node.value, bound)
            if dotted in known:
                found.append(f"{module.where(node)}: {dotted}.{node.attr}")
            elif (
                not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and node.attr in elsewhere
                and dotted is None
            ):
                found.append(f"{module.where(node)}: .{node.attr} of an object from another module")
        elif isinstance(node, ast.Call):
            args = node.args
            for owner, attribute in zip(args, args[1:]):  # setattr(module, "_x"), mock.patch.object(module, "_x")
                if (
                    isinstance(owner, ast.Name)
                    and owner.id in package_aliases
                    and isinstance(attribute, ast.Constant)
                    and isinstance(attribute.value, str)
                    and _is_private(attribute.value)
                ):
                    found.append(f"{module.where(node)}: {bound[owner.id]}.{attribute.value} (by name)")
            for arg in args[:1]:  # mock.patch("nemo_memlog.x._y")
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and arg.value.startswith(PACKAGE + ".")
                    and _is_private(arg.value.rsplit(".", 1)[-1])
                ):
                    found.append(f"{module.where(node)}: {arg.value} (by name)")
    return found


def test_no_module_uses_another_modules_private_name():
    problems = [f"  {use}" for module in modules().values() for use in _private_uses(module)]
    assert not problems, "private names used across modules:\n" + "\n".join(sorted(set(problems)))


#: The most lines a module of the package may have. Not a design rule (a module ends where its job
#: ends): a backstop against a module that has grown two jobs, set where no module presses it
#: (450 made modules be cut by count, and fragments follow: issue 57).
MAX_MODULE_LINES = 700
#: Module-level state allowed outside process_wide.py (whose job it is): a handful of registries,
#: each one named owner with a comment above it saying why no run can own it.
MAX_PROCESS_STATE = 6
#: What builds a mutable container when called (by the last part of its name).
MUTABLE_CALLS = {
    "list",
    "dict",
    "set",
    "defaultdict",
    "deque",
    "OrderedDict",
    "Counter",
    "WeakSet",
    "WeakValueDictionary",
    "WeakKeyDictionary",
}


#: The most modules one folder of the package holds directly: past it, a folder is a heap, and its
#: modules' name prefixes are hidden folders (issue 57: offline/ had 24, six of them postmortem_*).
MAX_FOLDER_MODULES = 16


def test_no_folder_holds_more_modules_than_a_reader_can_scan():
    crowded = {}
    for folder in [PACKAGE_DIR, *(p for p in PACKAGE_DIR.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if count > MAX_FOLDER_MODULES:
            crowded[str(folder.relative_to(PACKAGE_DIR.parent))] = count
    assert not crowded, f"folders over {MAX_FOLDER_MODULES} modules (cut them by job into packages): {crowded}"


def test_no_module_is_longer_than_a_sitting():
    long = {}
    for module in modules().values():
        path = PACKAGE_DIR / module.relative
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long[module.relative] = lines
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


@functools.cache
def _package_classes() -> frozenset[str]:
    return frozenset(
        node.name for module in modules().values() for node in ast.walk(module.tree) if isinstance(node, ast.ClassDef)
    )


def _is_state(value: ast.AST | None, name: str) -> bool:
    """Whether a module-level ``name = value`` holds mutable state: a container (a literal, or
    built by a call), or an instance of one of the package's classes. An upper-case name is a
    constant (PEP 8), a table or an object never changed after import, and a dunder (``__all__``)
    is what the module says of itself: neither is state."""
    if name.startswith("__") or name.lstrip("_").isupper():
        return False
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return called in MUTABLE_CALLS or called in _package_classes()
    return False


def _module_state(module: Module) -> list[tuple[str, int]]:
    found = []
    for node in module.tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, value = node.target.id, node.value
        else:
            continue
        if _is_state(value, name):
            found.append((name, node.lineno))
    return found


def _globals_rebound(module: Module) -> list[str]:
    return [module.where(node) for node in ast.walk(module.tree) if isinstance(node, ast.Global)]


def test_per_process_state_lives_in_process_wide_and_a_handful_of_named_registries():
    """Module-level mutable state outside process_wide.py (and the test helpers under testing/):
    at most MAX_PROCESS_STATE registries, each with a comment above it saying why it belongs to
    the process (the word "process"), and no ``global`` statement rebinding one."""
    registries, uncommented, rebound = [], [], []
    for module in modules().values():
        if module.relative == "process_wide.py" or module.relative.startswith("testing/"):
            continue
        source = (PACKAGE_DIR / module.relative).read_text().splitlines()
        for name, line in _module_state(module):
            registries.append(f"{module.relative}:{line} {name}")
            above = []
            for text in reversed(source[: line - 1]):
                if not text.startswith("#"):
                    break
                above.append(text)
            if "process" not in " ".join(above).lower():
                uncommented.append(f"{module.relative}:{line} {name}")
        rebound += _globals_rebound(module)
    assert len(registries) <= MAX_PROCESS_STATE, f"module-level state outside process_wide.py: {registries}"
    assert not uncommented, f"say in a comment above each why it belongs to the process: {uncommented}"
    assert not rebound, f"a global rebound at run time (give it an owner): {rebound}"


def _unannotated(module: Module) -> list[str]:
    """Public functions and methods (of public classes) of ``module`` with a parameter (self and
    cls aside) or a return (``__init__`` aside) that has no annotation."""
    missing = []

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                visit(child, f"{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name.startswith("_") and child.name != "__init__":
                    continue
                arguments = child.args
                params = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
                params += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
                bare = [a.arg for a in params if a.annotation is None and a.arg not in ("self", "cls")]
                if child.returns is None and child.name != "__init__":
                    bare.append("return")
                if bare:
                    missing.append(f"{module.where(child)} {owner}{child.name}: {', '.join(bare)}")

    visit(module.tree, "")
    return missing


def test_every_public_function_is_annotated():
    """What a user's type checker and IDE read: every public function's parameters and return
    (the test helpers under testing/ aside)."""
    missing = []
    for module in modules().values():
        if not module.relative.startswith("testing/"):
            missing += _unannotated(module)
    assert not missing, "annotate:\n" + "\n".join(missing)


def test_the_architecture_page_names_every_module():
    """docs/architecture.md promises the one file to open for a change: every module of the package is
    named there (by file name, as `name.py` or `name`), so a new module lands with its line."""
    page = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    unnamed = [
        module.relative
        for module in modules().values()
        if not module.relative.endswith("__init__.py")
        and not re.search(rf"`{re.escape(Path(module.relative).stem)}(\.py)?`", page)
        and module.relative not in page
    ]
    assert not unnamed, f"name these on docs/architecture.md, each with what it is for: {unnamed}"


def test_the_readme_stays_a_front_door():
    """README within 220 lines: detail belongs on the pages it links (docs/)."""
    lines = (PACKAGE_DIR.parent / "README.md").read_text().count("\n")
    assert lines <= 220, f"README.md is {lines} lines; move detail into docs/"


# ------------------------------------------------------------------------------------------
# (e) the claims of docs/architecture.md and of the package docstrings that can be read

ARCHITECTURE_PAGE = PACKAGE_DIR.parent / "docs" / "architecture.md"
#: The number words the page counts its registries in.
NUMBER_WORDS = ("none", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _named_in_docstring(stem: str, docstring: str) -> bool:
    """``stem`` named as a module: ``stem``, ``stem.py`` or ``stem/`` in double backquotes, stem.py or
    stem/ in the text, or a list or table line that starts with it."""
    name = re.escape(stem)
    return bool(re.search(rf"``{name}(\.py|/)?``|\b{name}\.py\b|\b{name}/|^[ \t]*(- )?{name}/?[:\s]", docstring, re.M))


def test_every_package_docstring_names_the_modules_in_its_folder():
    """Each package's __init__ docstring lists the modules and packages directly in its folder, so the
    folder's first page says what each holds (a new module lands with its line)."""
    unnamed = []
    for module in modules().values():
        if not module.is_package:
            continue
        folder = (PACKAGE_DIR / module.relative).parent
        docstring = ast.get_docstring(module.tree) or ""
        members = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        members += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
        unnamed += [f"  {module.relative}: {m}" for m in sorted(members) if not _named_in_docstring(m, docstring)]
    assert not unnamed, "name these in their package's docstring, each with what it holds:\n" + "\n".join(unnamed)


def _registries_counted() -> set[str]:
    """What the per-process state test counts: ``relative name`` of each module-level state."""
    return {
        f"{module.relative} {name}"
        for module in modules().values()
        if module.relative != "process_wide.py" and not module.relative.startswith("testing/")
        for name, _ in _module_state(module)
    }


def test_the_architecture_page_lists_the_registries_that_are_counted():
    """The page's registries (its number word, and its list of "- `module.py` `name`: ..." lines under
    process_wide.py) are exactly the module-level state the per-process state test counts."""
    page = ARCHITECTURE_PAGE.read_text()
    (entry,) = re.findall(r"^- `process_wide\.py`:.*?(?=^- `)", page, re.M | re.S)
    listed = {f"{path} {name}" for path, name in re.findall(r"^  - `([\w/]+\.py)` `(\w+)`:", entry, re.M)}
    (word,) = re.findall(r"(\w+) other registries", entry)
    counted = _registries_counted()
    assert listed == counted, (
        f"on the page, not counted: {listed - counted}; counted, not on the page: {counted - listed}"
    )
    assert NUMBER_WORDS.index(word.lower()) == len(counted), (word, sorted(counted))


def _gate_rows() -> list[list[str]]:
    """The rows of the page's table of ways in (its header starts ``| way in | module |``)."""
    page = ARCHITECTURE_PAGE.read_text()
    table = page.split("| way in | module |", 1)[1].split("\n\n", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:] if line]


def test_the_architecture_page_says_who_calls_the_gate():
    """The page's table of ways in names every module that calls a monitor's ``log`` (the step whose
    gate is ``logs_at``), and says "asks `logs_at` itself" of exactly those that ask the gate
    themselves (beside monitor/__init__.py, where it is)."""
    rows = _gate_rows()
    listed = {row[1].strip("`") for row in rows}
    asking = {row[1].strip("`") for row in rows if "asks `logs_at` itself" in row[3]}
    calls_log, asks = set(), set()
    for module in modules().values():
        if module.relative.startswith("testing/") or module.relative == "monitor/__init__.py":
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and node.attr == "logs_at":
                asks.add(module.relative)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "log"
                and ast.unparse(node.func.value).endswith("monitor")
            ):
                calls_log.add(module.relative)
    assert {"monitor/training_log.py", "integrations/lightning.py"} <= calls_log, calls_log
    assert listed == calls_log, f"in the table, no log call: {listed - calls_log}; not in it: {calls_log - listed}"
    assert asking == asks, f"the table says asks `logs_at` itself: {sorted(asking)}; the code: {sorted(asks)}"


def test_a_test_module_imports_helpers_never_another_test_module():
    """The page's list of the helper modules in tests/ is every module there that is not a test
    (``test_*.py``) nor a package's ``__init__``, and no module under tests/ imports a test module."""
    tests_dir = PACKAGE_DIR.parent / "tests"
    page = " ".join(ARCHITECTURE_PAGE.read_text().split())
    (sentence,) = re.findall(r"the helper modules beside it in `tests/` \(([^)]*)\)", page)
    listed = set(re.findall(r"`([\w/]+\.py)`", sentence))
    helpers = {
        p.relative_to(tests_dir).as_posix()
        for p in tests_dir.rglob("*.py")
        if not p.name.startswith("test_") and p.name != "__init__.py"
    }
    assert listed == helpers, f"on the page, no such helper: {listed - helpers}; not on the page: {helpers - listed}"
    imported = []
    for path in tests_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names += [f"{node.module or ''}.{a.name}" for a in node.names] + [node.module or ""]
            imported += [f"{path.relative_to(tests_dir)}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not imported, "import a helper module (or nemo_memlog.testing), not a test module:\n" + "\n".join(imported)
