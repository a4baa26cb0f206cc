"""The layering the design depends on, checked on the source: an import graph read with ``ast``, asserted rule by rule.

Every ``import`` and ``from ... import`` counts, wherever it is: under ``if TYPE_CHECKING:``, inside a function, or a
``importlib.import_module("...")`` with a literal (or literal-prefixed) name. Relative imports are resolved.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "backends", "loadtests")

# What routing may import: pure standard-library modules, the hash ring library, and itself. No I/O of any kind.
ROUTING_ALLOWED = (
    "__future__", "abc", "array", "bisect", "collections", "dataclasses", "enum", "functools", "hashlib", "heapq",
    "itertools", "math", "operator", "random", "statistics", "time", "types", "typing", "uhashring", "gateway.routing",
    "_md5",  # CPython's built-in md5 (ring.py: cheaper than hashlib's for a key's point)
)  # fmt: skip


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module
    target: str  # what it names, dotted: a module, or a module then an attribute (``gateway.routing.ring.Ring``)
    where: str  # file:line, the file relative to the tree's root

    def __str__(self) -> str:
        return f"{self.importer} -> {self.target} ({self.where})"


@dataclass(frozen=True)
class Graph:
    imports: dict[str, list[Import]]  # every module of the packages, with what it imports

    def module_of(self, target: str) -> str | None:
        """The graph's module that ``target`` names or lies in (``a.b.Name`` -> ``a.b``), if any."""
        parts = target.split(".")
        while parts and ".".join(parts) not in self.imports:
            parts.pop()
        return ".".join(parts) or None


def under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve_from(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute module of ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def dynamic_target(call: ast.Call) -> str | None:
    """The module an ``import_module("x.y")`` or ``import_module(f"x.{name}")`` call names, as far as it is literal."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(first := arg.values[0], ast.Constant):
        return str(first.value).rpartition(".")[0] or None
    return None


def targets(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = resolve_from(importer, is_package, node.level, node.module)
        return [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]
    if isinstance(node, ast.Call) and (target := dynamic_target(node)):
        return [target]
    return []


def imports_of(root: Path, path: Path) -> list[Import]:
    importer, is_package, file = module_name(root, path), path.name == "__init__.py", path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), str(path))
    return [
        Import(importer, target, f"{file}:{getattr(node, 'lineno', 0)}")
        for node in ast.walk(tree)
        for target in targets(node, importer, is_package)
    ]


def build_graph(root: Path, packages: Sequence[str] = PACKAGES) -> Graph:
    paths = sorted(path for package in packages for path in (root / package).rglob("*.py"))
    return Graph({module_name(root, path): imports_of(root, path) for path in paths})


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, a]``) in the module graph, or None. Depth first, in sorted order: deterministic."""
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> list[str] | None:
        if module in stack:
            return [*stack[stack.index(module) :], module]
        if module in done:
            return None
        for successor in sorted(edges.get(module, ())):
            if cycle := visit(successor, [*stack, module]):
                return cycle
        done.add(module)
        return None

    return next((cycle for module in sorted(edges) if (cycle := visit(module, []))), None)


class Check(Protocol):
    def violations(self, graph: Graph) -> list[str]: ...


@dataclass(frozen=True)
class Layer:
    """Modules under ``importers`` (but not ``exempt``) import nothing ``forbidden`` and, if given, only ``allowed``."""

    importers: tuple[str, ...]
    forbidden: tuple[str, ...] = ()
    allowed: tuple[str, ...] | None = None
    exempt: tuple[str, ...] = ()

    def refuses(self, target: str) -> bool:
        return under(target, self.forbidden) or (self.allowed is not None and not under(target, self.allowed))

    def violations(self, graph: Graph) -> list[str]:
        return [
            str(imp)
            for module, imports in graph.imports.items()
            if under(module, self.importers) and not under(module, self.exempt)
            for imp in imports
            if self.refuses(imp.target)
        ]


@dataclass(frozen=True)
class NoCycles:
    """No import cycle among the modules under ``packages`` (type-only and function-local imports count)."""

    packages: tuple[str, ...]

    def violations(self, graph: Graph) -> list[str]:
        edges = {
            module: {m for imp in imports if (m := graph.module_of(imp.target)) and under(m, self.packages)}
            for module, imports in graph.imports.items()
            if under(module, self.packages)
        }
        cycle = find_cycle(edges)
        return [] if cycle is None else ["import cycle: " + " -> ".join(cycle)]


@dataclass(frozen=True)
class InterfaceOnly:
    """Modules under ``importers`` reach ``package`` only through its ``interface`` modules (a new engine in
    backends/ must not need an edit in the gateway, so the gateway never names one)."""

    importers: tuple[str, ...]
    package: str
    interface: tuple[str, ...]

    def violations(self, graph: Graph) -> list[str]:
        return [
            str(imp)
            for module, imports in graph.imports.items()
            if under(module, self.importers)
            for imp in imports
            if under(imp.target, (self.package,)) and not under(imp.target, self.interface)
        ]


ROUTING_NO_IO = Layer(("gateway.routing",), allowed=ROUTING_ALLOWED)
BACKENDS_BELOW_GATEWAY = Layer(("backends",), forbidden=("gateway",))
SIM_STANDS_ALONE = Layer(("loadtests.sim",), forbidden=("gateway", "backends"))
ONLY_CLI_REACHES_LOADTESTS = Layer(("gateway", "backends"), forbidden=("loadtests",), exempt=("gateway.cli",))
NO_CYCLES = NoCycles(("gateway", "backends"))
GATEWAY_SEES_NO_ENGINE = InterfaceOnly(
    ("gateway",), "backends", ("backends.base", "backends.errors", "backends.registry")
)

CHECKS = [
    pytest.param(ROUTING_NO_IO, id="routing-imports-no-io"),
    pytest.param(BACKENDS_BELOW_GATEWAY, id="backends-import-no-gateway"),
    pytest.param(SIM_STANDS_ALONE, id="sim-imports-no-gateway-or-backends"),
    pytest.param(ONLY_CLI_REACHES_LOADTESTS, id="only-the-cli-imports-loadtests"),
    pytest.param(NO_CYCLES, id="no-import-cycles"),
    pytest.param(GATEWAY_SEES_NO_ENGINE, id="gateway-imports-only-the-backends-interface"),
]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(ROOT)


@pytest.mark.parametrize("check", CHECKS)
def test_boundary(graph: Graph, check: Check) -> None:
    problems = check.violations(graph)
    assert not problems, "\n".join(problems)


# The checker itself, on a fake tree: each check finds what was planted for it, and nothing else.
FAKE_TREE = {
    "gateway/__init__.py": "",
    "gateway/routing/__init__.py": "",
    "gateway/routing/ok.py": "from __future__ import annotations\nimport math\nfrom . import x\n",
    "gateway/routing/x.py": "def f():\n    import aiohttp\n",
    "gateway/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway import b\n",
    "gateway/b.py": "from .a import A\n",
    "gateway/fleet.py": "from loadtests.sim import engine\nimport importlib\n"
    "importlib.import_module('loadtests.demo')\n",
    "gateway/cli.py": "import importlib\ndef sim():\n    return importlib.import_module(f'loadtests.{name}')\n",
    "backends/__init__.py": "",
    "backends/d.py": "def g():\n    from ..gateway.routing import ok\n",
    "gateway/c.py": "from backends.base import Endpoint\nfrom backends.d import g\n",
    "loadtests/__init__.py": "",
    "loadtests/sim/__init__.py": "",
    "loadtests/sim/engine.py": "import backends.d as d\n",
}
PLANTED = [
    pytest.param(ROUTING_NO_IO, ["gateway.routing.x -> aiohttp (gateway/routing/x.py:2)"], id="routing-imports-no-io"),
    pytest.param(
        BACKENDS_BELOW_GATEWAY, ["backends.d -> gateway.routing.ok (backends/d.py:2)"], id="backends-import-no-gateway"
    ),
    pytest.param(
        SIM_STANDS_ALONE,
        ["loadtests.sim.engine -> backends.d (loadtests/sim/engine.py:1)"],
        id="sim-imports-no-gateway-or-backends",
    ),
    pytest.param(
        ONLY_CLI_REACHES_LOADTESTS,
        [
            "gateway.fleet -> loadtests.sim.engine (gateway/fleet.py:1)",
            "gateway.fleet -> loadtests.demo (gateway/fleet.py:3)",
        ],
        id="only-the-cli-imports-loadtests",
    ),
    pytest.param(NO_CYCLES, ["import cycle: gateway.a -> gateway.b -> gateway.a"], id="no-import-cycles"),
    pytest.param(
        GATEWAY_SEES_NO_ENGINE,
        ["gateway.c -> backends.d.g (gateway/c.py:2)"],
        id="gateway-imports-only-the-backends-interface",
    ),
]


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(("check", "expected"), PLANTED)
def test_the_checker_finds_what_was_planted(tmp_path: Path, check: Check, expected: list[str]) -> None:
    assert check.violations(build_graph(write_tree(tmp_path, FAKE_TREE))) == expected


@pytest.mark.parametrize(
    ("importer", "is_package", "level", "module", "absolute"),
    [
        ("gateway.fleet.pool", False, 1, "health", "gateway.fleet.health"),
        ("gateway.fleet.pool", False, 2, "routing.ring", "gateway.routing.ring"),
        ("gateway.fleet", True, 1, None, "gateway.fleet"),
        ("gateway.fleet", True, 2, "config", "gateway.config"),
        ("gateway.cli", False, 0, "gateway.config", "gateway.config"),
    ],
)
def test_relative_imports_resolve(
    importer: str, is_package: bool, level: int, module: str | None, absolute: str
) -> None:
    assert resolve_from(importer, is_package, level, module) == absolute


def test_a_cycle_is_found_only_where_there_is_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_each_package_imports_only_what_docs_architecture_says_it_may(graph: Graph) -> None:
    """docs/architecture.md, "Packages and what each may import": for each gateway package whose row names what it
    may import (not serving's 'everything below' nor admin's 'anything in gateway'), every import of another
    gateway module or of backends is one the row names; 'backends' allows any of its interface modules."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `gateway/([a-z_]+)/` \| [^|]* \| ([^|]*) \|$", text, re.MULTILINE)
    packages = {path.parent.name for path in (ROOT / "gateway").glob("*/__init__.py")}
    assert packages == {package for package, _ in rows}, "each gateway package has one row, no row names none"
    checked, undocumented = 0, []
    for package, may_import in rows:
        if "everything" in may_import or "anything" in may_import:
            continue
        named = set(re.findall(r"[a-z_]+(?:\.[a-z_]+)?", re.sub(r"\bno [a-z/ ]+", "", may_import)))  # not "no fleet"
        checked += 1
        for module, imports in graph.imports.items():
            if not under(module, (f"gateway.{package}",)):
                continue
            for imp in imports:
                target = graph.module_of(imp.target)
                if target is None or under(target, (f"gateway.{package}",)):
                    continue
                parts = target.split(".")
                allowed = (parts[0] == "gateway" and parts[1] in named) or (
                    parts[0] == "backends" and ("backends" in named or target in named)
                )
                if parts[0] in ("gateway", "backends") and not allowed:
                    undocumented.append(str(imp))
    assert checked >= 5 and not undocumented, "\n".join(undocumented)
