"""The package's import structure: no cycle between zorro_core's modules, and a light `import zorro_core`."""

import ast
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zorro_core"
# Only the benchmark harness and the CLI may import these (a trainer imports zorro_core).
HEAVY = ("pandas", "matplotlib", "typer", "rich")


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the zorro_core modules it imports anywhere in its source, function bodies and
    TYPE_CHECKING blocks included: an import moved into a function to dodge a cycle still counts."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{name}: relative import (use absolute zorro_core imports)")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zorro_core":
                edges.add(node.module)
                edges.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.split(".")[0] == "zorro_core")
        unknown = edges - set(mods)
        assert not unknown, f"{name} imports modules that do not exist: {sorted(unknown)}"
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_intra_package_imports_are_acyclic():
    graph = import_graph()
    assert "zorro_core.actor.actor" in graph and "zorro_core.actor.microbatch" in graph["zorro_core.actor.actor"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Modules of an optional trainer that is installed only in its own environment (.ci/verl_tests,
# .ci/openrlhf_tests).
OPTIONAL = {
    "verl": tuple(
        f"zorro_core.integrations.{m}"
        for m in ("verl_engine", "verl_cpu", "verl_rows", "verl_batching", "verl_trainer")
    ),
    "openrlhf": ("zorro_core.integrations.openrlhf",),
}


def test_every_module_imports_in_a_fresh_interpreter_and_zorro_core_stays_light():
    import importlib.util

    skip = {m for dep, mods in OPTIONAL.items() if importlib.util.find_spec(dep) is None for m in mods}
    names = sorted(set(modules()) - skip)
    code = (
        "import importlib, json, sys\n"
        "import zorro_core\n"
        f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(heavy))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


# The layers, bottom first: a package imports only from its own layer and those below it.
LAYERS = [
    {"errors", "plan"},
    {"attention", "models", "stack", "distributed"},
    {"actor"},
    {"integrations", "verify", "bench"},
]


def layer_of(module: str) -> int:
    package = module.split(".")[1] if module.count(".") else ""
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    return len(LAYERS)  # the package's __init__ (the public names) sits on top


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) > layer_of(a) and b != "zorro_core"
    )


def test_layers_import_one_way():
    graph = import_graph()
    assert {"zorro_core.plan.batch", "zorro_core.attention.hook", "zorro_core.actor.actor"} <= set(graph)
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import():
    assert upward_imports({"zorro_core.plan.cost": {"zorro_core.actor.actor"}}) == [
        "zorro_core.plan.cost -> zorro_core.actor.actor"
    ]
