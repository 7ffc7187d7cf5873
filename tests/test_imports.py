"""One-way imports (DESIGN.md), checked on the source with `ast`: nothing here is imported.

Every import counts, also those inside functions and under `TYPE_CHECKING`: a lazy import that
dodges a circle, or a type named from a higher floor, is the layering problem this guards.
Checks: no import circle between modules of `mla_backend`, `mla_kernels` and `mla_tools`; no
module imports a layer above its own (`LAYERS`); `serving/` reaches the engine only through its
front door (`FRONT_DOOR`, apart from `KNOWN_BACK_DOORS`); `mla_kernels` imports torch, triton and
the standard library only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("mla_backend", "mla_kernels", "mla_tools")

# (module prefix, layer), first match wins; the root `mla_backend` (an empty __init__) is "base".
LAYER_OF: tuple[tuple[str, str], ...] = (
    ("mla_kernels", "mla_kernels"),
    ("mla_tools", "mla_tools"),
    ("mla_backend.config", "base"),
    ("mla_backend.request", "base"),
    ("mla_backend.host_tensors", "base"),
    ("mla_backend.distributed", "distributed"),
    ("mla_backend.mem_cache", "mem_cache"),
    ("mla_backend.forward_batch", "forward_batch"),
    ("mla_backend.tokenizer", "tokenizer"),
    ("mla_backend.layers", "layers"),
    ("mla_backend.models", "models"),
    ("mla_backend.model_executor", "model_executor"),
    ("mla_backend.scheduler", "scheduler"),
    ("mla_backend.constrained.spec", "base"),  # plain parsing of the request fields
    ("mla_backend.constrained", "constrained"),
    ("mla_backend.engine", "engine"),
    ("mla_backend.client", "client"),
    ("mla_backend.serving", "serving"),
)
# The layers each layer stands on directly; it may import those and everything below them
# (`serving → client → engine → scheduler → forward_batch → mem_cache → base` and
# `engine → model_executor → models → layers → forward_batch, distributed, mla_kernels`).
LAYERS: dict[str, tuple[str, ...]] = {
    "mla_kernels": (),
    "base": (),  # config, request, host_tensors: plain data and settings
    "distributed": ("base",),  # the process-wide TP group
    "mem_cache": ("base",),
    "forward_batch": ("mem_cache",),
    "tokenizer": ("base",),
    "layers": ("forward_batch", "distributed", "mla_kernels"),
    "models": ("layers",),
    "model_executor": ("models",),  # ModelRunner, CUDA graphs, sampler, TP workers
    "scheduler": ("forward_batch",),  # never the model side
    "constrained": ("base",),  # structured outputs: grammars and token masks (xgrammar)
    "engine": ("model_executor", "scheduler", "tokenizer", "constrained"),
    "client": ("engine",),  # the engine's front door for servers
    "serving": ("client",),
    "mla_tools": ("serving",),  # developer tools: anything; nothing imports them
}
# What `serving/` may import of the engine's package: the engine's front door and plain data.
FRONT_DOOR = frozenset({"serving", "client", "base"})
# Known back doors (importer, imported): none.
KNOWN_BACK_DOORS: frozenset[tuple[str, str]] = frozenset()
KERNEL_THIRD_PARTY = frozenset({"torch", "triton"})


def module_files(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of PACKAGES under `root`."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = [pkg, *path.relative_to(root / pkg).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported_names(name: str, path: Path) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of every import in the file, wherever it stands."""
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one
            found += [(f"{mod}.{alias.name}", node.lineno) for alias in node.names]
            found.append((mod, node.lineno))
    return found


def import_graph(files: dict[str, Path]) -> tuple[dict[str, set[str]], dict[tuple[str, str], str],
                                                  dict[str, set[str]]]:
    """(edges between our modules, "file:line" of each edge, third-party top-level names each
    module imports). `from a import b` counts as an import of `a.b` if that is a module of ours,
    else of `a`."""
    edges: dict[str, set[str]] = {m: set() for m in files}
    where: dict[tuple[str, str], str] = {}
    external: dict[str, set[str]] = {m: set() for m in files}
    for name, path in files.items():
        names = _imported_names(name, path)
        ours = {n for n, _ in names if n in files}
        for target, line in names:
            if target.partition(".")[0] not in PACKAGES:
                external[name].add(target.partition(".")[0])
                continue
            # a `from a import b` gives both a.b and a: keep the submodule when it is one of ours
            if f"{target}." in {o[:len(target) + 1] for o in ours if o != target}:
                continue
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
                where.setdefault((name, target), f"{path.relative_to(REPO)}:{line}")
    return edges, where, external


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
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
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> str:
    if module == "mla_backend":
        return "base"
    for prefix, layer in LAYER_OF:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise KeyError(f"module {module} has no layer: add it to LAYER_OF in {__file__}")


def below(layer: str) -> set[str]:
    """The layers `layer` may import: itself and everything under it."""
    seen, todo = {layer}, list(LAYERS[layer])
    while todo:
        lay = todo.pop()
        if lay not in seen:
            seen.add(lay)
            todo += LAYERS[lay]
    return seen


def layer_violations(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module's layer is not below the importer's."""
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if layer_of(b) not in below(layer_of(a)))


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str], dict[str, set[str]]]:
    files = module_files()
    edges, where, external = import_graph(files)
    # not vacuous: the packages were found and their imports read
    assert len(files) > 60 and sum(map(len, edges.values())) > 150
    assert "mla_backend.scheduler.scheduler" in edges["mla_backend.engine"]
    return edges, where, external


def test_checker_finds_circles_and_upward_imports() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(edges) == [["a", "b", "c"]]
    up = {"mla_backend.layers.linear": {"mla_backend.model_executor.model_runner"},
          "mla_backend.model_executor.model_runner": {"mla_backend.layers.linear"}}
    assert layer_violations(up) == [("mla_backend.layers.linear",
                                     "mla_backend.model_executor.model_runner")]
    assert layer_of("mla_kernels.decode_attention") == "mla_kernels"
    with pytest.raises(KeyError):
        layer_of("mla_backend.new_package.x")


def test_every_module_has_a_layer(graph) -> None:
    edges, _, _ = graph
    for module in edges:
        assert layer_of(module) in LAYERS


def test_no_import_circle(graph) -> None:
    edges, where, _ = graph
    cycles = find_cycles(edges)
    detail = [[where[(a, b)] for a in c for b in c if (a, b) in where] for c in cycles]
    assert not cycles, f"import circles: {cycles} (imports: {detail})"


def test_no_import_runs_back_up(graph) -> None:
    edges, where, _ = graph
    bad = [f"{a} -> {b} ({where[(a, b)]}; {layer_of(a)} may not import {layer_of(b)})"
           for a, b in layer_violations(edges)]
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


def test_serving_uses_the_engine_front_door(graph) -> None:
    edges, where, _ = graph
    back = {(a, b) for a, targets in edges.items() if layer_of(a) == "serving"
            for b in targets if layer_of(b) not in FRONT_DOOR}
    new = sorted(back - KNOWN_BACK_DOORS)
    assert not new, "serving/ imports past the engine's front door: " + ", ".join(
        f"{a} -> {b} ({where[(a, b)]})" for a, b in new)
    gone = sorted(KNOWN_BACK_DOORS - back)
    assert not gone, f"closed back doors still listed in KNOWN_BACK_DOORS: {gone}"


def test_kernels_import_torch_and_triton_only(graph) -> None:
    _, _, external = graph
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = {m: sorted(names - stdlib - KERNEL_THIRD_PARTY) for m, names in external.items()
           if layer_of(m) == "mla_kernels" and names - stdlib - KERNEL_THIRD_PARTY}
    assert not bad, f"mla_kernels imports beyond torch and triton: {bad}"
