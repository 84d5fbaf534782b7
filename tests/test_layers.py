"""The house rules that keep the packages readable, checked on every CI run.

Layers import only downwards: specs (the shared models and file formats) -> presets -> profiler ->
planner -> trainer -> reports -> advisor (the CLI verbs and the compositions, the one composition
root). Each layer is a top-level package, so the folders show the order. import-linter checks the
contract declared in pyproject.toml; the AST checks below also see imports inside functions, and check
that the contract names every package as one layer (a new package cannot slip out of it).
"""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["specs", "presets", "profiler", "planner", "trainer", "reports", "advisor"]
PACKAGES = LAYERS
LONG_FUNCTION_LINES = 80


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _project_imports(tree: ast.AST) -> list[tuple[ast.stmt, str]]:
    """(node, imported module) for every absolute import of a project package in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node, node.module))
    return [(node, name) for node, name in out if name.split(".")[0] in PACKAGES]


def _function_level(tree: ast.AST) -> set[int]:
    """ids of import nodes that sit inside a function body."""
    inside = set()
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(func) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return inside


def _import_block_with_comment(lines: list[str], node: ast.stmt) -> str:
    """The import's lines, the imports right above it, and the comment line above those."""
    first = node.lineno - 1
    while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
        first -= 1
    return " ".join(lines[max(0, first - 1):node.end_lineno])


def test_no_module_imports_a_layer_above_it() -> None:
    upward = []
    for module, path in _modules().items():
        for node, imported in _project_imports(ast.parse(path.read_text())):
            if _layer(imported) > _layer(module):
                upward.append(f"{path.relative_to(ROOT)}:{node.lineno} {module} -> {imported}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_project_modules_are_imported_at_module_top() -> None:
    """Function-level imports of project modules are allowed only to defer a heavy dependency, and
    then say so in a comment containing "deferred" on the import line or above its block of imports."""
    hidden = []
    for module, path in _modules().items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        nested = _function_level(tree)
        for node, imported in _project_imports(tree):
            if id(node) in nested and "deferred" not in _import_block_with_comment(lines, node):
                hidden.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {imported} inside a function")
    assert not hidden, "\n".join(hidden)


def _long_functions(source: str, where: str) -> list[str]:
    """Every function (nested and async ones too) longer than LONG_FUNCTION_LINES, decorators not counted."""
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > LONG_FUNCTION_LINES:
                long.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return long


def test_the_length_rule_counts_every_line_of_a_function_and_sees_nested_and_async_ones() -> None:
    def function(name: str, lines: int, indent: str = "", prefix: str = "def") -> str:
        body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))  # the def line is the first
        return f"{indent}{prefix} {name}():\n{body}"

    source = (function("exactly_80", 80) + function("top_81", 81) + function("wait_81", 81, prefix="async def")
              + "class C:\n" + function("method_81", 81, indent="    ")
              + "def outer():\n" + function("inner_81", 81, indent="    "))
    found = _long_functions(source, "x.py")
    assert [line.split()[1] for line in found] == ["top_81", "wait_81", "outer", "method_81", "inner_81"], found
    assert "x.py:81 top_81 (81 lines)" in found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_longer_than_80_lines(package: str) -> None:
    """Every shipped package, advisor's CLI included (issue 30)."""
    paths = sorted((ROOT / package).rglob("*.py"))
    assert paths, f"no Python files under {package}/"
    long = [line for path in paths for line in _long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert not long, "\n".join(long)


def test_no_lower_package_imports_the_cli_package() -> None:
    """The CLI's package sits on top (issue 30): nothing below it imports `advisor`, at module top or
    inside a function."""
    below = [f"{path.relative_to(ROOT)}:{node.lineno} {imported}" for module, path in _modules().items()
             if not module.startswith("advisor")
             for node, imported in _project_imports(ast.parse(path.read_text())) if imported.split(".")[0] == "advisor"]
    assert not below, "\n".join(below)
    assert (ROOT / "advisor" / "cli").is_dir() and not [p for p in (ROOT / "advisor").glob("*.py")
                                                     if p.name != "__init__.py"], "advisor holds the CLI only"


def test_import_linter_layers_contract_holds_and_names_every_package_as_a_layer() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    assert contract["layers"] == LAYERS[::-1], "the contract lists the packages top to bottom"
    assert sorted(config["root_packages"]) == sorted(LAYERS)
    found = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name not in ("tests", "bench"))
    assert found == sorted(LAYERS), f"a package outside the layers: {found}"
    done = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
                           "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_planner_and_the_capacity_report_load_no_torch() -> None:
    """A pure planner (issue 30): importing every planner module and the capacity report leaves torch
    unloaded, so `advisor report capacity --jobs N` plans in N forked processes (reports/capacity.py
    forks only while torch is not loaded: its thread pools do not survive a fork)."""
    planner_modules = sorted(p.stem for p in (ROOT / "planner").glob("*.py") if p.stem != "__init__")
    code = ("import sys, importlib\n"
            f"for name in {planner_modules!r}:\n"
            "    importlib.import_module('planner.' + name)\n"
            "import reports.capacity\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert len(planner_modules) >= 10
    assert result.stdout.strip() == "[]", result.stdout[:400]


ENGINE_DECLARATION = {"specs/capabilities.py", "specs/engine_traits.py"}


def _engine_name_comparisons(path: Path) -> list[str]:
    """Comparisons of a value with an engine's name (a literal, or the declaration's constants)."""
    from specs.capabilities import PRICED_ENGINES
    from specs.engine_traits import TRAITS

    names = set(TRAITS) | set(PRICED_ENGINES)
    constants = {"MEGATRON", "FSDP_BF16", "PURE16_PLAIN", "OURS"}
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(isinstance(o, ast.Attribute) and o.attr == "modules" for o in operands):
            continue  # `"deepspeed" in sys.modules`: a module, not an engine
        literals = set()
        for o in operands:
            elements = o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o]
            literals |= {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            literals |= {e.id for e in elements if isinstance(e, ast.Name) and e.id in constants}
        if literals & (names | constants):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.get_source_segment(source, node)}")
    return found


def test_no_code_outside_the_declaration_compares_an_engines_name() -> None:
    """Engine knowledge is declared once (issue 30): the cost model, the memory model, the exports, the
    dry run, the trainer and the CLI read an engine's traits (specs/engine_traits.py) or its
    capabilities (specs/capabilities.py), never its name."""
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if str(path.relative_to(ROOT)) not in ENGINE_DECLARATION:
                found += _engine_name_comparisons(path)
    assert not found, "\n".join(found)


def test_the_engine_name_check_sees_each_kind_of_comparison(tmp_path: Path) -> None:
    probe = ROOT / "tests" / "_engine_name_probe.py"  # under ROOT: the check reports paths relative to it
    probe.write_text('if engine == "deepspeed" or e in ("fsdp2", "pipeline") or x != MEGATRON or "ours" == p:\n'
                     '    pass\nif "deepspeed" in sys.modules or device == "cuda":\n    pass\n')
    try:
        # four comparisons of engine names on line 1; a module's name and a device's on line 3 are not
        assert [line.split()[0] for line in _engine_name_comparisons(probe)] == ["tests/_engine_name_probe.py:1"] * 4
    finally:
        probe.unlink()


def test_the_cost_model_stays_a_composition_of_small_modules() -> None:
    """cost_model.py was the most-changed file at 1,013 lines (issue 30): it composes the stage's memory,
    compute, communication and optimizer terms, each in its own module, and stays under 500 lines."""
    lines = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "planner").glob("*.py")}
    assert lines["cost_model.py"] < 500, lines["cost_model.py"]
    for part in ("stage_params.py", "stage_memory.py", "compute_time.py", "comm_time.py", "optimizer_step.py"):
        assert part in lines
