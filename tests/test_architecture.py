"""The project's import graph: acyclic, and every import goes down the documented layer order.

The layers (lowest first), as drawn in docs/ARCHITECTURE.md. A module may import modules of its own
layer or of a lower one, never of a higher one; no two modules import each other, directly or
through others (imports inside functions count too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("planner", "passes", "runtime", "costmodels")

# (layer name, module-name prefixes); a module belongs to the first layer whose prefix it matches.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors and files", ("planner.errors", "planner.files", "planner.progress")),
    ("cost models", ("costmodels",)),
    ("front end", ("planner.frontend",)),
    ("plan", ("planner.plan",)),
    ("solver", ("planner.solver",)),
    ("passes", ("passes",)),
    ("runtime", ("runtime",)),
    ("command line", ("planner.cli", "planner")),
]


def layer_of(module: str) -> int:
    """Index into LAYERS of `module` (a dotted name inside the project)."""
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            modules[module_name(path)] = path
    return modules


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports (module level or inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            target = resolve(name)
            if target is not None:
                found.add(target)
    return found


def import_graph() -> nx.DiGraph:
    modules = project_modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in imported_modules(path, modules):
            if target != name and not name.startswith(target + "."):  # a package's own __init__
                graph.add_edge(name, target)
    return graph


def test_import_graph_has_no_cycle() -> None:
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_imports_follow_the_layer_order() -> None:
    bad = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, b in import_graph().edges
        if layer_of(b) > layer_of(a)
    ]
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_layer_check_catches_an_upward_import(tmp_path: Path) -> None:
    # the check itself can fail: a cost model importing the solver is against the order
    assert layer_of("planner.solver.ilp") > layer_of("costmodels.comm")
    assert layer_of("planner.cli.main") > layer_of("runtime.execute") > layer_of("passes.tensor_parallel")


# pricing the command line may not do itself: the cost models' formulas, calibration's timers, the
# solver's cost tables (`layer_key` names a layer class, it prices nothing)
PRICING_MODULES = ("costmodels.compute", "costmodels.comm", "costmodels.memory")
PRICING_NAMES = {
    "costmodels.calibrate": {"matmul_shape_time_ratios", "conv_time_ratios", "activation_time_ratios",
                             "attention_time_ratios",
                             "graph_node_time_ratio", "probe_model", "spec_threads"},
    "planner.solver.costing": None,  # every name but the allowed ones
}  # fmt: skip
ALLOWED_COSTING = {"layer_key"}


def pricing_in(path: Path) -> list[str]:
    """The pricing a command-line module does itself: imports of the cost models' formulas or timers,
    and specs whose device it rebuilds (`replace(..., device=...)`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module in PRICING_MODULES:
                found.append(f"{path.name}:{node.lineno} imports {node.module}")
            elif node.module in PRICING_NAMES:
                banned = PRICING_NAMES[node.module]
                for alias in node.names:
                    if (banned is None and alias.name not in ALLOWED_COSTING) or (
                        banned and alias.name in banned
                    ):
                        found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "replace":
            if any(k.arg == "device" for k in node.keywords):
                found.append(f"{path.name}:{node.lineno} rebuilds a cluster spec's device")
    return found


def test_the_command_line_prices_nothing_itself() -> None:
    """Pricing (the cost models, calibration's timers, a spec refined with the model's own timings)
    lives in costmodels and planner.solver (`planner.solver.machine.priced_machine`); planner.cli only
    orchestrates and renders."""
    found = [hit for path in sorted((ROOT / "planner" / "cli").glob("*.py")) for hit in pricing_in(path)]
    assert not found, found


def test_the_pricing_check_catches_a_spec_rebuilt_in_the_command_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from dataclasses import replace\nfrom costmodels.calibrate import matmul_shape_time_ratios\n"
        "def f(c):\n    return replace(c, device=replace(c.device, node_overhead_s=1.0))\n"
    )
    assert len(pricing_in(bad)) == 2  # the timer imported, the device rebuilt
