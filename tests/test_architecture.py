"""Import directions (DESIGN.md "Layout"), checked on every Python file in the repository.

services -> rpc -> protos, services -> engine; nothing imports a service; engine/ never
imports grpc; the scheduling and bookkeeping modules of engine/ never import torch, not
even through another module of ours.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
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


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module imported anywhere in ``source`` (nested too)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    # `if TYPE_CHECKING:` imports never run; they exist for annotations only.
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
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
def import_graph() -> dict[str, set[str]]:
    graph = {}
    for rel in python_files():
        module = module_name(rel)
        source = (REPO / rel).read_text(encoding="utf-8")
        graph[module] = imports_of(source, module, rel.name == "__init__.py")
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
