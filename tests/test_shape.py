"""The package keeps the shape STYLE.md describes, read from the source (ast): nothing is
imported and no process is started, so this runs in well under a second.

- no module imports another in a circle (imports inside functions count too);
- a backend's library (wandb, mlflow, comet_ml, TensorBoard's SummaryWriter, tensorboardX) is
  named only in its own writer module under nemo_memlog/writers/;
- no torch.distributed collective outside the nemo_memlog/reduce/ package, and none of
  torch.distributed in its pure protocol module (nemo_memlog/reduce/protocol.py);
- no module uses another module's private name;
- nothing under nemo_memlog/offline imports torch, directly or through what it imports.

Every module of the package is read, nemo_memlog/testing/ included: the helpers that tests and
scripts share are code too, and a cycle or a private name there decays the same way. Only the
collective rule exempts them: they build the test clusters and time the field's reductions.
"""

from __future__ import annotations

import ast
import functools
import re
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
}
#: Names that mean the library wherever they stand. "wandb", "mlflow" and "tensorboard" alone
#: are also the names of our own writer modules and registry keys, so for those only an import
#: of the library (static, or by a dotted string such as "wandb.sdk") counts.
UNAMBIGUOUS = {"comet_ml", "tensorboardX", "SummaryWriter"}
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
    top_level: bool  # runs when the module is imported (not inside a function)


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


def _function_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside a function or lambda (imports there run only when it is called) or
    under ``if TYPE_CHECKING:`` (they never run: a type checker reads them)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(child) for child in ast.walk(node) if child is not node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            inside.update(id(child) for statement in node.body for child in ast.walk(statement))
    return inside


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache
def imports(name: str) -> tuple[Import, ...]:
    """Every import in module ``name``, at any depth, with string-literal import_module calls."""
    module = modules()[name]
    inside = _function_nodes(module.tree)
    found = []
    for node in ast.walk(module.tree):
        top = id(node) not in inside
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), node, top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(Import(_absolute(module, node), tuple(a.name for a in node.names), node, top))
        elif isinstance(node, ast.Call) and _called_name(node) in DYNAMIC_IMPORTS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append(Import(first.value, (), node, top))
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


# ------------------------------------------------------------------------------------------
# (a) no import cycle


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one importing itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


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


def test_no_module_imports_another_in_a_circle():
    graph, lines = {}, {}
    for name, module in modules().items():
        for imported in imports(name):
            for target in package_targets(imported):
                if target != name:
                    graph.setdefault(name, set()).add(target)
                    lines.setdefault((name, target), module.where(imported.node))
    problems = []
    for component in _cycles(graph):
        members = set(component)
        edges = [f"    {lines[a, b]}: {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        problems.append(f"  cycle among {', '.join(component)}:\n" + "\n".join(edges))
    assert not problems, "modules that import each other in a circle:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------------
# (a') layers that only look down (docs/architecture.md, "Layers")

#: The package's layers, bottom to top, each by its modules (a name covers a package and all
#: below it). A module imports from its own layer or those below it, never from one above.
LAYERS = (
    ("leaf", ("process_wide", "parts", "units", "bounded", "redaction", "commands", "warn")),
    ("settings", ("config",)),
    ("measurement and the failure path", ("memory", "host_limit", "megatron", "measure", "failure")),
    ("reduction and writers", ("payload", "attribution", "metrics", "reduce", "writers")),
    ("advice", ("advice",)),
    ("the run", ("placement", "monitor", "hook")),
    ("integrations and entry points", ("integrations", "bridge", "lightning", "megatron_lm", "cli", "")),
)
#: Apart from the layers: the offline commands (no torch; they read the layers' pure modules up to
#: the advice, and only the entry points reach them) and the helpers of tests and scripts.
OFFLINE, TESTING = f"{PACKAGE}.offline", f"{PACKAGE}.testing"
OFFLINE_READS_UP_TO = "advice"
ENTRY_POINTS = "integrations and entry points"


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int | None:
    """The index in LAYERS of module ``name``; None for a module apart (offline/, testing/)."""
    if _within(name, OFFLINE) or _within(name, TESTING):
        return None
    found = [
        index
        for index, (_, members) in enumerate(LAYERS)
        for member in members
        if (name == PACKAGE if member == "" else _within(name, f"{PACKAGE}.{member}"))
    ]
    assert len(found) == 1, f"{name} belongs to {len(found)} layers of LAYERS: place it in exactly one"
    return found[0]


def _import_edges():
    for name, module in modules().items():
        for imported in imports(name):
            for target in package_targets(imported):
                if target != name:
                    yield module, name, target, imported.node


def _layer_problem(name: str, target: str) -> str | None:
    """What is wrong with module ``name`` importing module ``target``, or None."""
    names = [title for title, _ in LAYERS]
    if _within(name, TESTING):
        return None
    if _within(target, TESTING):
        return "the package imports its test helpers"
    source, wanted = layer_of(name), layer_of(target)
    if _within(name, OFFLINE):
        if wanted is not None and wanted > names.index(OFFLINE_READS_UP_TO):
            return f"the offline commands read up to the {OFFLINE_READS_UP_TO} layer; {target} is in {names[wanted]!r}"
        return None
    if _within(target, OFFLINE):
        return None if names[source] == ENTRY_POINTS else "only the entry points import the offline commands"
    if wanted > source:
        return f"upward: {names[source]!r} -> {names[wanted]!r}"
    return None


def test_every_module_sits_in_one_layer():
    """A new module is placed in LAYERS (and docs/architecture.md), or apart, before it lands."""
    for name in modules():
        layer_of(name)


def test_no_import_runs_upward_through_the_layers():
    """Imports inside functions count too (they run when called); ``if TYPE_CHECKING:`` ones do not."""
    problems = []
    for module, name, target, node in _import_edges():
        problem = _layer_problem(name, target)
        if problem:
            problems.append(f"  {module.where(node)}: {name} -> {target} ({problem})")
    assert not problems, "imports against the layers (tests/test_shape.py LAYERS):\n" + "\n".join(sorted(set(problems)))


def test_the_layers_catch_an_import_upward_and_into_the_offline_commands():
    """The rule itself, on made-up edges: it can fail."""
    assert _layer_problem(f"{PACKAGE}.warn", f"{PACKAGE}.config") == "upward: 'leaf' -> 'settings'"
    assert _layer_problem(f"{PACKAGE}.measure.phase", f"{PACKAGE}.monitor").startswith("upward")
    assert _layer_problem(f"{PACKAGE}.advice.model", f"{PACKAGE}.offline.tables") is not None
    assert _layer_problem(f"{PACKAGE}.offline.report", f"{PACKAGE}.monitor") is not None
    assert _layer_problem(f"{PACKAGE}.monitor", f"{PACKAGE}.testing.cluster") is not None
    assert _layer_problem(f"{PACKAGE}.monitor", f"{PACKAGE}.memory") is None
    assert _layer_problem(f"{PACKAGE}.cli", f"{PACKAGE}.offline.cli") is None


def test_the_layers_are_written_in_the_architecture_page():
    """docs/architecture.md lists the same layers, bottom to top, each with its modules."""
    page = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    section = page.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [" ".join(item.split()) for item in re.split(r"\n(?=\d+\. )", section) if re.match(r"\d+\. ", item)]
    assert len(rows) == len(LAYERS), rows
    for row, (title, members) in zip(rows, LAYERS):
        assert f"**{title}**" in row, (row, title)
        for member in filter(None, members):
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


# ------------------------------------------------------------------------------------------
# (e) the offline commands never import torch


def _runs_on_import(name: str) -> list[str]:
    """What importing ``name`` runs: its parent packages' __init__ and the module."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules()]


def _torch_paths(start: str) -> list[str]:
    """Import chains from offline module ``start`` to torch: every import of an offline module
    counts (a command calls its functions); elsewhere only the imports run at import time."""
    seen, found, queue = set(), [], [(m, []) for m in _runs_on_import(start)]
    while queue:
        name, chain = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        offline = name.startswith(f"{PACKAGE}.offline")
        for imported in imports(name):
            if not (imported.top_level or offline):
                continue
            step = [*chain, f"{modules()[name].where(imported.node)} imports {imported.target}"]
            if imported.target == "torch" or imported.target.startswith("torch."):
                found.append(" -> ".join(step))
            for target in package_targets(imported):
                queue += [(m, step) for m in _runs_on_import(target)]
    return found


def test_the_offline_commands_never_import_torch():
    problems = []
    for name in modules():
        if name.startswith(f"{PACKAGE}.offline"):
            problems += [f"  {path}" for path in _torch_paths(name)]
    assert not problems, "torch imported by the offline commands:\n" + "\n".join(sorted(set(problems)))


#: The most lines a module of the package may have: one job per module, readable in a sitting.
MAX_MODULE_LINES = 450
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
