"""Architecture rules that code review alone would let slip."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("cli", "flows", "pipeline", "models", "storage")
PACKAGES = ("cli", "pipeline", "models", "storage", "lab")


def _imports(source: str) -> set[str]:
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _modules(source: str) -> set[str]:
    """Full names of the modules a source imports (`from a import b` counts a.b too: b may be
    a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _under(names: set[str], *prefixes: str) -> set[str]:
    return {n for n in names for p in prefixes if n == p or n.startswith(p + ".")}


def _files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in (REPO / pkg).rglob("*.py")]


def test_the_import_check_sees_every_form():
    src = "import flows.pipeline\nfrom cli import main\nfrom . import sibling\n"
    assert _imports(src) == {"flows", "cli"}


def test_the_module_check_sees_submodules():
    src = "from pipeline.stages import sft\nimport pipeline.core.config\n"
    names = _modules(src)
    assert _under(names, "pipeline.stages") == {"pipeline.stages", "pipeline.stages.sft"}
    assert _under(names, "pipeline.core") == {"pipeline.core.config"}


def test_a_stage_imports_only_the_shared_machinery_below_it():
    # Code two stages need lives in pipeline/core; a stage reads another's output, never its
    # code, and never reaches up to chains, profiles, experiments or top-level modules.
    for p in (REPO / "pipeline" / "stages").rglob("*.py"):
        if p.name == "__init__.py":
            continue
        names = _under(_modules(p.read_text()), "pipeline") - {"pipeline"}
        bad = {n for n in names if not n.startswith("pipeline.core")}
        assert not bad, f"{p.relative_to(REPO)} imports {sorted(bad)} (only pipeline.core)"


def test_core_imports_nothing_above_it():
    above = ("pipeline.stages", "pipeline.chains", "pipeline.profiles")
    above += ("pipeline.distributed",)
    for p in _files("pipeline/core"):
        bad = _under(_modules(p.read_text()), *above)
        assert not bad, f"{p.relative_to(REPO)} imports {sorted(bad)}"


def test_drafter_kinds_are_reached_only_through_the_interface():
    # A new kind is a package in models/ plus its line in models.drafters.KINDS: nothing else
    # names a kind's modules, so no stage, command or benchmark has to change for it.
    from models.drafters import KINDS

    kinds = tuple(f"models.{kind}" for kind in KINDS)
    for p in _files("pipeline", "cli", "flows", "lab", "storage"):
        bad = _under(_modules(p.read_text()), *kinds)
        assert not bad, f"{p.relative_to(REPO)} imports a drafter kind's module {sorted(bad)}"
    for p in _files("models"):
        inside = p.relative_to(REPO / "models").parts[0]
        if p.name == "drafters.py" or inside in KINDS:
            continue
        bad = _under(_modules(p.read_text()), *kinds)
        assert not bad, f"{p.relative_to(REPO)} imports a drafter kind's module {sorted(bad)}"


KIND_NAME_EXCEPTIONS = {
    # vLLM's own speculative-method name, the default of its engine spec (models/vllm_engine.py
    # wraps vLLM's API; the kind a caller serves passes its spec's serve_method).
    "models/vllm_engine.py",
}


def _kind_names(source: str, kinds: tuple[str, ...]) -> list[str]:
    """String constants that name a drafter kind (the name itself, or `kind=<name>`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in kinds or any(f"kind={k}" in node.value for k in kinds):
                found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_the_kind_name_check_sees_names_and_settings():
    src = 'a = "eagle3"\nb = f"--set drafter.kind=dflash {x}"\nc = "eagle3 chains"\n'
    assert _kind_names(src, ("eagle3", "dflash")) == [
        "line 1: 'eagle3'",
        "line 2: '--set drafter.kind=dflash '",
    ]


def test_no_kind_name_outside_its_package_and_the_registry():
    # A kind describes itself (models/<kind>/__init__.py: its SPEC); everything else reads the
    # registry, so a new kind is its package plus its line in models.drafters.KINDS.
    from models.drafters import KINDS

    kinds = tuple(KINDS)
    for p in _files(*PACKAGES, "flows"):
        rel = p.relative_to(REPO).as_posix()
        if rel in KIND_NAME_EXCEPTIONS or rel == "models/drafters.py":
            continue
        if rel.startswith("models/") and p.relative_to(REPO / "models").parts[0] in KINDS:
            continue
        assert not (bad := _kind_names(p.read_text(), kinds)), f"{rel} names a kind: {bad}"


def test_only_flows_import_prefect():
    offenders = [
        str(p.relative_to(REPO)) for p in _files(*PACKAGES) if "prefect" in _imports(p.read_text())
    ]
    assert not offenders, f"Prefect imported outside flows/: {offenders}"


def test_nothing_in_the_product_imports_the_lab():
    # The lab (experiments, benchmarks, recipes, findings) builds on the product; the product
    # installs and runs without it. Lazy imports count: they still run.
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts) for p in _files("lab")}
    modules |= {"lab"} | {m.removesuffix(".__init__") for m in modules}
    for p in _files(*PRODUCT):
        bad = _under(_project_imports(p.read_text(), modules), "lab")
        assert not bad, f"{p.relative_to(REPO)} imports the lab: {sorted(bad)}"


def test_the_lab_check_sees_a_lazy_import():
    modules = {"lab", "lab.cli", "lab.experiments", "lab.experiments.ablate"}
    lazy = "def f():\n    from lab.experiments import ablate\n"
    assert _project_imports(lazy, modules) == {"lab.experiments.ablate"}
    assert _project_imports("import lab.cli\n", modules) == {"lab.cli"}


def test_imports_point_one_way():
    # cli -> flows -> pipeline -> (models, storage); nothing imports a layer above its own.
    for pkg, banned in (
        ("flows", {"cli"}),
        ("pipeline", {"flows", "cli"}),
        ("models", {"pipeline", "flows", "cli"}),
        ("storage", {"pipeline", "flows", "models", "cli"}),
    ):
        for p in _files(pkg):
            bad = _imports(p.read_text()) & banned
            assert not bad, f"{p.relative_to(REPO)} imports {bad}"


def _unpickling_calls(source: str) -> list[str]:
    """Calls that can unpickle: pickle/dill/joblib loads, torch.load without weights_only=True,
    numpy loads with allow_pickle=True."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        name = node.func.attr
        true = {
            k.arg
            for k in node.keywords
            if isinstance(k.value, ast.Constant) and k.value.value is True
        }
        if owner in ("pickle", "dill", "joblib") and name in ("load", "loads"):
            found.append(f"line {node.lineno}: {owner}.{name}")
        elif owner == "torch" and name == "load" and "weights_only" not in true:
            found.append(f"line {node.lineno}: {owner}.{name} without weights_only=True")
        elif owner in ("np", "numpy") and name == "load" and "allow_pickle" in true:
            found.append(f"line {node.lineno}: {owner}.{name} with allow_pickle=True")
    return found


def test_the_unpickling_check_finds_what_it_must():
    bad = "\n".join(
        [
            "import pickle, torch, numpy as np",
            "pickle." + "loads(b)",
            "torch." + "load(path)",
            "torch." + "load(path, weights_only=False)",
            "np." + "load(path, allow_pickle=True)",
        ]
    )
    assert len(_unpickling_calls(bad)) == 4
    good = "torch." + "load(path, weights_only=True)\nnp." + "load(path)"
    assert _unpickling_calls(good) == []


def test_no_unpickling_calls():
    for p in _files(*PACKAGES, "flows", "tests"):
        found = _unpickling_calls(p.read_text())
        assert not found, f"{p.relative_to(REPO)}: {found}"


def _project_imports(source: str, modules: set[str]) -> set[str]:
    """The project modules a source imports anywhere, function bodies included (a lazy import
    still runs, so it can still close a circle), except under `if TYPE_CHECKING:`."""
    tree = ast.parse(source)
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # `from a import b`: the module a.b, else a's own names
                full = f"{node.module}.{a.name}"
                found |= {full} if full in modules else {node.module} & modules
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (module -> modules it imports), [] when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        path.append(module)
        for dep in sorted(graph[module]):
            if found := visit(dep):
                return found
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if found := visit(module):
            return found
    return []


def test_the_cycle_check_sees_lazy_imports_and_skips_type_checking_ones():
    modules = {"models.a", "models.b", "models.c"}
    lazy = "def f():\n    from models.b import thing\n"
    assert _project_imports(lazy, modules) == {"models.b"}
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import models.b\n"
    assert _project_imports(typing_only, modules) == set()
    assert _project_imports("from models import a, x\n", modules) == {"models.a"}
    circle = {"models.a": {"models.b"}, "models.b": {"models.c"}, "models.c": {"models.a"}}
    assert _cycle(circle) == ["models.a", "models.b", "models.c", "models.a"]
    assert _cycle({"models.a": {"models.b"}, "models.b": set()}) == []


def test_no_import_cycles():
    # Every module can be imported on its own, from the top: an import circle held together
    # only by function-level imports breaks as soon as someone moves one of them up.
    files = {}
    for p in _files(*PACKAGES, "flows"):
        parts = p.relative_to(REPO).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {m: _project_imports(p.read_text(), set(files)) - {m} for m, p in files.items()}
    cycle = _cycle(graph)
    assert not cycle, f"import cycle: {' -> '.join(cycle)}"


def test_the_cli_and_the_configs_start_without_transformers():
    # `opd ls/show/gc/--help` and the parent of an `opd run --nproc N` launch (it checks the
    # config, then starts the ranks) never build a model: importing transformers cost each of
    # them ~3 s of a ~5 s start on 2 cores, paid again by every launch. Only code that loads a
    # target or tokenizer imports it, inside the function that does.
    code = (
        "import sys, cli.main, lab.cli, pipeline.profiles, pipeline.distributed, pipeline.chains\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'vllm'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
