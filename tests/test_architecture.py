"""Import directions (DESIGN.md "Layout"), checked on every Python file in the repository.

services -> rpc -> protos, services -> engine; nothing imports a service; engine/ never
imports grpc; the scheduling and bookkeeping modules of engine/ never import torch, not
even through another module of ours. Inside gateway/, the modules import each other
without a cycle (annotation-only imports included), and its parts are layered: text
processing and tool calling below routing, routing below the two front ends (HTTP and
gRPC), which do not import each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator
from functools import cache
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".venv", "venv", "build", "dist", "node_modules", "__pycache__"}

GRPC_ROOTS = {"grpc", "grpc_health", "grpc_reflection", "grpc_tools", "google", "protos", "rpc"}
TORCH_FREE_ENGINE = {
    "engine.config",
    "engine.request",
    "engine.sampling_params",
    "engine.kv_layout",
    "engine.errors",
    "engine.block_pool",
    "engine.scheduler",
    "engine.cpu_budget",
    "engine.constraint",
    "engine.grammar",
}
NON_PRODUCTION = {"tests", "benchmarks"}


def python_files() -> Iterator[Path]:
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts[:-1]):
            continue
        yield rel


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool, type_checking: bool = False) -> set[str]:
    """Absolute names of every module imported anywhere in ``source`` (nested too); those
    under ``if TYPE_CHECKING:`` only when ``type_checking``."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    # `if TYPE_CHECKING:` imports never run; they exist for annotations only.
    for node in ast.walk(tree):
        if (
            not type_checking
            and isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING"
        ):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts)
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            # `from pkg import sub` may import a submodule.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name}


@cache
def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    graph = {}
    for rel in python_files():
        module = module_name(rel)
        source = (REPO / rel).read_text(encoding="utf-8")
        graph[module] = imports_of(source, module, rel.name == "__init__.py", type_checking)
    return graph


def top(name: str) -> str:
    return name.split(".", 1)[0]


def service_packages() -> set[str]:
    return {top(m) for m in import_graph() if top(m) == "gateway" or top(m).endswith("_service")}


def violations(prefix: str, forbidden: set[str]) -> list[str]:
    """``module imports name`` for each module under ``prefix`` importing a forbidden root."""
    return [
        f"{module} imports {name}"
        for module, names in sorted(import_graph().items())
        if top(module) == prefix
        for name in sorted(names)
        if top(name) in forbidden
    ]


def test_walk_finds_the_layers() -> None:
    modules = set(import_graph())
    for expected in ("engine.request", "engine.sampling_params", "rpc.errors", "rpc.server"):
        assert expected in modules
    assert "tests.test_architecture" in modules


def test_import_collector_sees_nested_and_relative_imports() -> None:
    source = "import a.b\nfrom .sib import x\ndef f():\n    from ..up import y\n    import torch\n"
    found = imports_of(source, "pkg.sub.mod", is_package=False)
    assert {"a.b", "pkg.sub.sib", "pkg.sub.sib.x", "pkg.up", "pkg.up.y", "torch"} <= found


def test_type_checking_imports_are_not_runtime_imports() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nimport os\n"
    assert imports_of(source, "m", False) == {"typing", "typing.TYPE_CHECKING", "os"}
    assert "torch" in imports_of(source, "m", False, type_checking=True)
    assert "torch" in imports_of(source, "m", False, type_checking=True)


def test_engine_imports_no_grpc_protos_rpc_or_service() -> None:
    forbidden = GRPC_ROOTS | service_packages() | NON_PRODUCTION
    assert violations("engine", forbidden) == []


def test_rpc_imports_no_torch_or_service() -> None:
    assert violations("rpc", {"torch"} | service_packages() | NON_PRODUCTION) == []


def test_protos_import_only_grpc_and_protobuf() -> None:
    ours = {"engine", "rpc"} | service_packages() | NON_PRODUCTION
    assert violations("protos", ours) == []


def test_protos_and_the_client_need_nothing_but_grpc_protobuf_and_the_stdlib() -> None:
    """protos/ is also the ``baton-client`` distribution (protos/pyproject.toml), which
    depends on grpcio and protobuf only: no torch, transformers or numpy may creep in."""
    allowed = set(sys.stdlib_module_names) | {"grpc", "google", "protos"}
    others = {top(name) for names in import_graph().values() for name in names} - allowed
    assert violations("protos", others) == []
    assert any(m.startswith("protos.client.") for m in import_graph())


def test_no_service_imports_another_service() -> None:
    services = service_packages()
    bad = []
    for service in sorted(services):
        bad += violations(service, services - {service})
    assert bad == []


def test_production_code_imports_no_tests_or_benchmarks() -> None:
    roots = {top(m) for m in import_graph()} - NON_PRODUCTION
    bad = []
    for root in sorted(roots):
        bad += violations(root, NON_PRODUCTION)
    assert bad == []


def _reaches_torch(start: str) -> list[str] | None:
    """An import chain from ``start`` to torch through modules of ours, or None."""
    graph = import_graph()
    parts = start.split(".")
    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
    seeds = [".".join(parts[: i + 1]) for i in range(len(parts))]
    seen = {m for m in seeds if m in graph}
    stack = [(m, [m]) for m in seeds if m in graph]
    while stack:
        module, chain = stack.pop()
        for name in sorted(graph.get(module, ())):
            if top(name) == "torch":
                return [*chain, name]
            parts = name.split(".")
            for step in (".".join(parts[: i + 1]) for i in range(len(parts))):
                if step in graph and step not in seen:
                    seen.add(step)
                    stack.append((step, [*chain, step]))
    return None


def test_torch_free_modules_never_reach_torch() -> None:
    graph = import_graph()
    starts = sorted(m for m in graph if m in TORCH_FREE_ENGINE or top(m) == "rpc")
    chains = {m: chain for m in starts if (chain := _reaches_torch(m)) is not None}
    assert chains == {}, "torch reached through: " + "; ".join(
        " -> ".join(c) for c in chains.values()
    )


# Each gateway part -> the parts it must not reach, directly or through other modules.
GATEWAY_LAYERS = {
    "gateway.text": ("gateway.routing", "gateway.http", "gateway.grpc_api"),
    "gateway.tools": ("gateway.routing", "gateway.http", "gateway.grpc_api"),
    "gateway.routing": ("gateway.http", "gateway.grpc_api"),
    "gateway.http": ("gateway.grpc_api",),
    "gateway.grpc_api": ("gateway.http",),
}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_edges(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """Each module under ``package`` -> the modules under it that it imports. ``from a.b
    import c`` imports a, a.b and (if it is a module) a.b.c; a module's own enclosing
    packages, which always run before it, are left out."""
    edges = {}
    for module, names in graph.items():
        if not under(module, package):
            continue
        parts = module.split(".")
        own = {".".join(parts[: i + 1]) for i in range(len(parts))}
        targets = set()
        for name in names:
            steps = name.split(".")
            for i in range(len(steps)):
                step = ".".join(steps[: i + 1])
                if step in graph and under(step, package) and step not in own:
                    targets.add(step)
        edges[module] = targets
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(edges.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == module:
                    break
            if len(group) > 1 or module in edges.get(module, ()):
                groups.append(group)

    for module in sorted(edges):
        if module not in index:
            visit(module)
    cycles = []
    for group in groups:
        start = min(group)
        path = _path(edges, start, lambda m, start=start: m == start, group)
        assert path is not None
        cycles.append(path)
    return cycles


def _path(
    edges: dict[str, set[str]],
    start: str,
    is_goal: Callable[[str], bool],
    allowed: set[str] | None = None,
) -> list[str] | None:
    """The shortest import chain from ``start`` (at least one import) to a module that
    ``is_goal``, through ``allowed`` modules only if given; or None. Of the modules one
    import names, the deepest comes first (``a.b.c`` before its package ``a.b``), so the
    chain names what was imported."""
    seen: set[str] = set()
    queue = deque([[start]])
    while queue:
        chain = queue.popleft()
        for target in sorted(edges.get(chain[-1], ()), key=lambda m: (-len(m), m)):
            if is_goal(target):
                return [*chain, target]
            if target not in seen and (allowed is None or target in allowed):
                seen.add(target)
                queue.append([*chain, target])
    return None


def describe(chain: list[str]) -> str:
    return ", ".join(f"{a} imports {b}" for a, b in pairwise(chain))


def layering_violations(
    edges: dict[str, set[str]], layers: dict[str, tuple[str, ...]]
) -> list[str]:
    """For each module of a part that reaches a part it must not: the chain of imports."""
    found = []
    for package, forbidden in sorted(layers.items()):
        for module in sorted(m for m in edges if under(m, package)):
            for banned in forbidden:
                chain = _path(edges, module, lambda m, banned=banned: under(m, banned))
                if chain is not None:
                    found.append(f"{package} must not reach {banned}: {describe(chain)}")
    return found


def test_cycle_and_layer_checks_name_the_imports() -> None:
    edges = {"g.a": {"g.b"}, "g.b": {"g.c"}, "g.c": {"g.a"}, "g.d": {"g.d"}, "g.e": set()}
    assert import_cycles(edges) == [["g.a", "g.b", "g.c", "g.a"], ["g.d", "g.d"]]
    assert import_cycles({"g.a": {"g.b"}, "g.b": set()}) == []
    layered = {"g.low.x": {"g.mid"}, "g.mid": {"g.top.y"}, "g.top.y": set()}
    assert layering_violations(layered, {"g.low": ("g.top",)}) == [
        "g.low must not reach g.top: g.low.x imports g.mid, g.mid imports g.top.y"
    ]
    graph = {"g": set(), "g.p": set(), "g.p.m": {"g.p.n.X", "g.q"}, "g.p.n": set(), "g.q": set()}
    assert module_edges(graph, "g")["g.p.m"] == {"g.p.n", "g.q"}


def test_gateway_imports_have_no_cycle_even_for_annotations() -> None:
    edges = module_edges(import_graph(type_checking=True), "gateway")
    assert "gateway.validation" in edges and "gateway.text.tokenizer" in edges
    cycles = import_cycles(edges)
    assert cycles == [], "import cycles in gateway/: " + "; ".join(map(describe, cycles))


def test_gateway_parts_are_layered() -> None:
    edges = module_edges(import_graph(type_checking=True), "gateway")
    for package in GATEWAY_LAYERS:
        assert any(under(m, package) and m != package for m in edges), package
    bad = layering_violations(edges, GATEWAY_LAYERS)
    assert bad == [], "\n".join(bad)


def test_no_tracked_file_holds_merge_conflict_markers() -> None:
    """A conflict left in a docstring or a comment still imports and runs; only a look at
    every tracked text file finds it."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    markers = (b"<<<<<<< ", b">>>>>>> ")
    found = []
    for name in filter(None, tracked):
        path = REPO / name.decode()
        if not path.is_file() or path.stat().st_size > 4 << 20:
            continue
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if line.startswith(markers):
                found.append(f"{name.decode()}:{number}")
    assert not found, f"merge conflict markers: {found}"
