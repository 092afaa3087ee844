"""The import structure of the house: zorro_core (what a trainer imports) below zorro_harness (benchmarks,
analysis) below zorro_cli. No cycle between modules or between packages, layers that import one way, no
private name imported across packages, and a zorro_core that loads no harness or CLI dependency."""

import ast
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOP = ("zorro_core", "zorro_harness", "zorro_cli")
# Only the harness and the CLI may import these (a trainer imports zorro_core).
HEAVY = ("pandas", "matplotlib", "typer", "rich")


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for top in TOP:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> tuple[set[str], list[str]]:
    """The project modules `name` imports anywhere in its source (function bodies and TYPE_CHECKING
    blocks included: an import moved into a function to dodge a cycle still counts), and the private
    names it imports from another package."""
    edges, private = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{name}: relative import (use absolute imports)")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in TOP:
            edges.add(node.module)
            edges.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods)
            if package_of(node.module) != package_of(name):
                private += [f"{name}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if a.name.split(".")[0] in TOP)
    return edges, private


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        edges, _ = _imports(name, path, mods)
        unknown = edges - set(mods)
        assert not unknown, f"{name} imports modules that do not exist: {sorted(unknown)}"
        graph[name] = edges - {name}
    return graph


def package_of(module: str) -> str:
    """A module's package: zorro_cli (one flat package), or a top package's first level (zorro_core.plan,
    zorro_harness.bench, zorro_core.errors); a top package's own __init__ (its public names) is its own."""
    parts = module.split(".")
    if (
        parts[:2] == ["zorro_core", "integrations"]
        and len(parts) > 2
        and (ROOT / "zorro_core/integrations" / parts[2]).is_dir()
    ):
        return ".".join(parts[:3])  # a trainer's package (integrations.verl, .trl, .openrlhf) is a package of its own
    return parts[0] if parts[0] == "zorro_cli" else ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for a, targets in graph.items():
        packages.setdefault(package_of(a), set()).update(package_of(b) for b in targets)
    return {p: targets - {p} for p, targets in packages.items()}


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


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert "zorro_core.actor.microbatch" in graph["zorro_core.actor.actor"]
    assert "zorro_harness.bench.suite" in graph["zorro_harness.bench.sweep"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_two_packages_import_each_other():
    packages = package_graph(import_graph())
    assert {"zorro_core.plan", "zorro_harness.bench", "zorro_harness.analyze", "zorro_cli"} <= set(packages)
    cycle = find_cycle(packages)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def test_the_package_check_finds_two_packages_importing_each_other():
    graph = {"zorro_harness.bench.guard": {"zorro_harness.analyze.dataset"}, "zorro_harness.analyze.dataset": set()}
    graph["zorro_harness.analyze.analysis"] = {"zorro_harness.bench.inputs"}
    graph["zorro_harness.bench.inputs"] = set()
    assert find_cycle(package_graph(graph)) == ["zorro_harness.analyze", "zorro_harness.bench", "zorro_harness.analyze"]


def test_no_private_name_is_imported_across_packages():
    mods = modules()
    crossing = [line for name, path in sorted(mods.items()) for line in _imports(name, path, mods)[1]]
    assert crossing == []


# Modules of an optional trainer that is installed only in its own environment (.ci/verl_tests,
# .ci/openrlhf_tests; TRL is not in `.[dev]`, whose environment .ci/run's dev-only step checks).
# Each with its old path (a shim that imports the new module).
OPTIONAL = {
    "verl": tuple(
        f"zorro_core.integrations.{m}"
        for m in (
            "verl.engine",
            "verl.cpu",
            "verl.rows",
            "verl.batching",
            "verl.trainer",
            "verl.needs",
            "verl.critic",
            "verl.critic_worker",
            "verl.schedule",
        )
        + ("verl_engine", "verl_cpu", "verl_rows", "verl_batching", "verl_trainer", "needs_verl")
    ),
    # verl's Megatron engine: megatron-core and mbridge beside verl (.ci/verl_megatron_tests).
    "megatron": tuple(
        f"zorro_core.integrations.verl.{m}" for m in ("megatron_engine", "cpu_megatron", "needs_megatron")
    ),
    "trl": ("zorro_core.integrations.trl", "zorro_core.integrations.trl.trainer", "zorro_core.integrations.trl.window"),
    "openrlhf": (
        "zorro_core.integrations.openrlhf.actor",
        "zorro_core.integrations.openrlhf.batching",
        "zorro_core.integrations.openrlhf.critic",
        "zorro_core.integrations.openrlhf_batching",
    ),
}


def _import_in_a_fresh_interpreter(names: list[str]) -> list[str]:
    """Import `names` in a new interpreter; the HEAVY modules loaded afterwards."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
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
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_zorro_core_without_its_integrations_loads_no_harness_dependency():
    """What a trainer imports: every zorro_core module but the integrations (whose trainers bring their
    own dependencies) loads no pandas, matplotlib, typer or rich."""
    names = sorted(m for m in modules() if m.startswith("zorro_core") and not m.startswith("zorro_core.integrations"))
    assert len(names) > 40
    assert _import_in_a_fresh_interpreter(names) == []


def test_every_module_imports_in_a_fresh_interpreter():
    import importlib.util

    skip = {m for dep, mods in OPTIONAL.items() if importlib.util.find_spec(dep) is None for m in mods}
    names = sorted(set(modules()) - skip - {"zorro_cli.__main__"})
    _import_in_a_fresh_interpreter(names)


# The layers, bottom first: a module imports only from its own layer and those below it.
LAYERS = [
    {"zorro_core.errors", "zorro_core.plan"},
    {"zorro_core.attention", "zorro_core.models", "zorro_core.stack", "zorro_core.distributed"},
    {"zorro_core.actor"},
    {"zorro_core.integrations", "zorro_core.verify"},  # integrations: the core every trainer's package shares
    {"zorro_core.integrations.trl", "zorro_core.integrations.verl", "zorro_core.integrations.openrlhf"},
    {"zorro_core"},  # the package's __init__ (the public names)
    {"zorro_harness", "zorro_harness.bench"},
    {"zorro_harness.analyze"},
    {"zorro_cli"},
]


def layer_of(module: str) -> int:
    package = package_of(module)
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise AssertionError(f"{module} (package {package}) is in no layer: add its package to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_layers_import_one_way():
    graph = import_graph()
    assert {"zorro_core.plan.batch", "zorro_core.attention.hook", "zorro_core.actor.actor"} <= set(graph)
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import():
    assert upward_imports({"zorro_core.plan.cost": {"zorro_core.actor.actor"}}) == [
        "zorro_core.plan.cost -> zorro_core.actor.actor"
    ]
    assert upward_imports({"zorro_core.verify.gradients": {"zorro_harness.bench.footprint"}}) == [
        "zorro_core.verify.gradients -> zorro_harness.bench.footprint"
    ]


def test_the_drawn_house_is_the_import_graph():
    """scripts/draw_house.py reads the graph on its own; it must find the same arrows, none of them from
    zorro_core up to the harness or the CLI."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draw_house", ROOT / "scripts" / "draw_house.py")
    house = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(house)
    drawn = house.package_edges()
    ours = package_graph(import_graph())
    assert {p: t for p, t in drawn.items() if t} == {p: t for p, t in ours.items() if t}
    assert not [
        (a, b) for a, ts in drawn.items() for b in ts if a.startswith("zorro_core") and b.split(".")[0] != "zorro_core"
    ]
    assert "img/house.png" in (ROOT / "docs" / "architecture.md").read_text()


def test_no_trainer_package_imports_another():
    """Each trainer's package stands on the shared integration core and the library, never on another trainer's."""
    packages = package_graph(import_graph())
    trainers = {p for p in packages if p.startswith("zorro_core.integrations.")}
    assert trainers == {f"zorro_core.integrations.{t}" for t in ("trl", "verl", "openrlhf")}
    assert [(a, b) for a in trainers for b in packages[a] if b in trainers] == []
    assert not [p for p in ("zorro_core.integrations",) if packages[p] & trainers]


def test_architecture_file_list_is_the_tree():
    """docs/architecture.md's list of packages and modules is what scripts/draw_house.py draws from the tree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draw_house", ROOT / "scripts" / "draw_house.py")
    house = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(house)
    assert house.tree_block() in (ROOT / "docs" / "architecture.md").read_text(), (
        "docs/architecture.md's file list is stale: run python scripts/draw_house.py --write-tree"
    )


def test_plan_never_imports_attention():
    """The plan says what is computed; attention owns how its kernels see it (zorro_core.attention.layouts).
    No module of zorro_core.plan imports zorro_core.attention, not even inside a function."""
    graph = import_graph()
    plan = {m for m in graph if package_of(m) == "zorro_core.plan"}
    assert {"zorro_core.plan.trie", "zorro_core.plan.segments", "zorro_core.plan.trie_levels"} <= plan
    assert sorted(f"{a} -> {b}" for a in plan for b in graph[a] if b.startswith("zorro_core.attention")) == []
    assert "zorro_core.plan.trie_levels" in graph["zorro_core.attention.layouts"]


def test_attention_owns_its_layouts():
    """The layout types are attention's: no plan module defines or names them."""
    names = ("PaddedLayout", "CrossLayout", "Layouts")
    mods = modules()
    naming = [
        m for m, path in mods.items() if m.startswith("zorro_core.plan") and any(n in path.read_text() for n in names)
    ]
    assert naming == []
    assert not (ROOT / "zorro_core" / "plan" / "layouts.py").exists()


# -- the plugin entry points: a tiny module until there is work ------------------------------------

PLUGINS = ROOT / "zorro_plugins"


def _entry_points() -> list[str]:
    """The "verl.plugins" and "vllm.general_plugins" entry points pyproject.toml declares."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    return [v for g in ("verl.plugins", "vllm.general_plugins") for v in groups[g].values()]


def test_plugin_entry_points_load_a_tiny_module():
    """What verl (`import verl`) and vLLM (in each process) do with zorro's entry points, in a fresh
    interpreter: load each as declared and call the vLLM one with VERL_PLATFORM unset. They may
    import zorro_plugins (modules of the standard library's) and nothing else of zorro, nor
    torch or transformers; the after-import watcher waits for verl's trainer package."""
    code = (
        "import importlib, json, sys\n"
        "before = set(sys.modules)\n"
        f"for value in {_entry_points()!r}:\n"
        "    module, _, attr = value.partition(':')\n"
        "    loaded = importlib.import_module(module)\n"
        "    if attr:\n"
        "        getattr(loaded, attr)()\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    new = json.loads(res.stdout.strip().splitlines()[-1])
    ours = [m for m in new if m.split(".")[0].startswith("zorro")]
    assert ours and set(ours) <= {"zorro_plugins", "zorro_plugins.hooks", "zorro_plugins.verl", "zorro_plugins.vllm"}
    outside = [m for m in new if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith("zorro_plugins")]
    assert outside == []  # no torch, transformers, numpy: the standard library's modules only


def test_zorro_plugins_imports_only_the_standard_library():
    """Whatever the entry points load stays light: zorro_plugins imports no third-party package and
    nothing of zorro at module level (zorro's modules are imported by name when there is work)."""
    stdlib = set(sys.stdlib_module_names) | {"__future__", "zorro_plugins"}
    for path in PLUGINS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert {n.split(".")[0] for n in names} <= stdlib, (path.name, names)
