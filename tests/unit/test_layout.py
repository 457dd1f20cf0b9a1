"""The package layout: its layers hold (import-linter), no module reaches into another's private
names, README's layout names the tree, and a non-editable install carries the shipped configs."""

from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("aspo_lit", "data_modules", "experiments")


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the three packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layers() -> list[list[str]]:
    parser = configparser.ConfigParser()
    parser.read(REPO / ".importlinter")
    text = parser["importlinter:contract:layers"]["layers"]
    return [re.split(r"\s*[|:]\s*", line.strip()) for line in text.strip().splitlines()]


def test_import_layers_hold():
    """`lint-imports` (import-linter's layers contract in .importlinter): imports flow downward."""
    exe = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(exe), "--config", str(REPO / ".importlinter")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


def docstring_only(path: Path) -> bool:
    """A package's ``__init__.py`` that holds nothing but its docstring (a folder of modules that
    may sit in several layers: each of them is checked)."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                              for n in body)


def test_every_module_sits_in_a_layer():
    """The contract cannot pass by omission: every module is inside one listed layer."""
    listed = [name for layer in layers() for name in layer]
    loose = [m for m, path in modules().items() if m not in PACKAGES and m != "aspo_lit.__init__"
             and not docstring_only(path) and not any(m == name or m.startswith(name + ".") for name in listed)]
    assert loose == [], f"modules outside every layer of .importlinter: {loose}"


def where(path: Path, line: int) -> str:
    """`file:line`, the file relative to the repository when it is inside it."""
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}"


def imported_from(node: ast.ImportFrom, own: str, is_package: bool) -> str:
    """The absolute module an import takes its names from (`from ..x import y` in module `own`)."""
    if node.level == 0:
        return node.module or ""
    parts = own.split(".") if is_package else own.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path, own: str) -> list[str]:
    """Private names (`_x`, not dunders) of another project module that module `own` (file `path`)
    reaches: `from X import _x` (absolute or relative), and `X._x` where X names a project module
    (`import aspo_lit.x`, `from aspo_lit import x`, `from . import x`). One `file:line X._x` each."""
    tree = ast.parse(path.read_text(), str(path))
    project, found, bound = set(modules()), [], {}   # bound: {a name in this file: the module it names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = imported_from(node, own, path.name == "__init__.py")
            if source.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in project:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif private(alias.name) and source != own:
                    found.append((node.lineno, f"{where(path, node.lineno)} {source}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    name = alias.asname or alias.name.split(".")[0]
                    bound[name] = alias.name if alias.asname else name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                module = ".".join([bound[base.id], *chain])
                if module in project and module != own:
                    found.append((node.lineno, f"{where(path, node.lineno)} {module}.{node.attr}"))
    return [hit for _, hit in sorted(set(found))]


def module_getattr(path: Path) -> list[str]:
    """A module-level `__getattr__` (PEP 562): names that resolve lazily, a second home for a name
    that lives elsewhere. Statements at module level, inside `if`/`try`/`with` blocks too."""
    found, todo = [], list(ast.parse(path.read_text(), str(path)).body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__getattr__":
            found.append(f"{where(path, node.lineno)} def __getattr__")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                isinstance(t, ast.Name) and t.id == "__getattr__"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            found.append(f"{where(path, node.lineno)} __getattr__ = ...")
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *[stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]]
    return found


def test_no_private_names_across_modules():
    """A private name (`_x`) is used only in the module that defines it: one that another module
    needs is public API (a name without the underscore, with a docstring)."""
    found = [hit for name, path in modules().items() for hit in private_imports(path, name)]
    assert found == [], "private names reached from another module:\n  " + "\n  ".join(found)


def test_no_module_getattr():
    """No module resolves names lazily (PEP 562 `__getattr__`): every name is imported from the module
    that defines it, so each thing has one name and one home."""
    found = [hit for path in modules().values() for hit in module_getattr(path)]
    assert found == [], "module-level __getattr__ (import each name from its own module):\n  " + "\n  ".join(found)


def test_private_import_check_sees_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from aspo_lit.training.figures import _float\n")
    (hit,) = private_imports(bad, "x")
    assert hit.endswith(":1 aspo_lit.training.figures._float")


def test_private_name_checks_see_relative_imports_and_attributes(tmp_path):
    """`from .x import _y` (relative), `x._y` on an imported project module, and a module-level
    `__getattr__` are each reported with their line; a private name of the module itself, a dunder
    and an attribute of anything other than a project module are not."""
    bad = tmp_path / "__init__.py"   # read as the package aspo_lit.rollout
    bad.write_text("from .vllm_worker import _layer_kind, __all__\n"
                   "from aspo_lit.rollout import vllm, _own\n"
                   "import aspo_lit.rollout.hf\n"
                   "vllm._rng_states(vllm.__name__)\n"
                   "aspo_lit.rollout.hf._private\n"
                   "self._state\n"
                   "if True:\n"
                   "    def __getattr__(name): ...\n")
    assert private_imports(bad, "aspo_lit.rollout") == [
        f"{bad}:1 aspo_lit.rollout.vllm_worker._layer_kind", f"{bad}:4 aspo_lit.rollout.vllm._rng_states",
        f"{bad}:5 aspo_lit.rollout.hf._private"]
    assert module_getattr(bad) == [f"{bad}:8 def __getattr__"]


def layout_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Layout"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def test_readme_layout_names_the_tree():
    """Every module file is named in README's layout block (of tools/, every one outside perf/,
    which it names as a folder), and every file it names exists."""
    block = layout_block()
    named = set(re.findall(r"[\w-]+\.py\b", block))
    files = {path.name for path in modules().values() if path.name != "__init__.py"}
    tools = {path for path in (REPO / "tools").rglob("*.py") if path.name != "__init__.py"}
    assert sorted(files - named) == [], "modules missing from README's layout"
    assert sorted({p.name for p in tools if p.parent.name != "perf"} - named) == [], "tools missing from README's layout"
    assert sorted(named - files - {p.name for p in tools}) == [], "README's layout names files that do not exist"
    folders = {path.parent.relative_to(REPO).as_posix() for path in [*modules().values(), *tools]}
    for folder in folders:
        assert folder.split("/")[-1] + "/" in block, f"{folder}/ missing from README's layout"


def test_wheel_carries_the_configs(tmp_path):
    """A non-editable install (a wheel, no checkout around it) resolves `conf/...` to the configs
    shipped inside the package, so `python -m aspo_lit fit --config conf/aspo.yaml` works; it carries
    the shipped testbeds (their files matching their records) and references, and the library only: not
    the studies (experiments/) nor the tools (tools/), which run from a checkout."""
    source = tmp_path / "source"   # a copy: setuptools writes build/ into the tree it builds
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in (*PACKAGES, "conf", "tools"):
        shutil.copytree(REPO / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, timeout=300,
                   capture_output=True)
    wheel = next((tmp_path / "dist").glob("aspo_lit-*.whl"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, timeout=300, capture_output=True)
    packages = sorted(p.name for p in site.iterdir() if p.name != "bin" and not p.name.endswith(".dist-info"))
    assert packages == ["aspo_lit", "data_modules"], packages  # bin/: the aspo-lit script
    shipped = sorted(p.relative_to(site / "aspo_lit").as_posix() for p in (site / "aspo_lit" / "conf").rglob("*.yaml"))
    assert shipped == sorted(p.relative_to(REPO).as_posix() for p in (REPO / "conf").rglob("*.yaml"))
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = ("import aspo_lit, sys; from aspo_lit.configs import resolve_config;"
             "from aspo_lit.testbed.shipped import shipped_dir;"
             "print(aspo_lit.__file__); print(resolve_config('conf/aspo.yaml'));"
             "print(*[shipped_dir(n) for n in ('testbed', 'testbed-long', 'testbed-code')])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=work, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, check=True).stdout.split()
    assert out[0].startswith(str(site)), "the wheel's copy must be the one imported"
    assert Path(out[1]) == site / "aspo_lit" / "conf" / "aspo.yaml"
    assert Path(out[1]).read_text() == (REPO / "conf" / "aspo.yaml").read_text()
    assert out[2:] == [str(site / "aspo_lit" / "testbeds" / n) for n in ("testbed", "testbed-long", "testbed-code")]
    references = sorted(p.name for p in (site / "aspo_lit" / "references").glob("*.json"))
    assert references == sorted(p.name for p in (REPO / "aspo_lit" / "references").glob("*.json"))


def test_marker_map_names_existing_test_modules():
    """conftest's module → marker map (what `make test-fast` leaves out) names modules that exist, and
    every marker it applies is registered; a renamed test file would otherwise drop silently into the fast set.
    The map matches a module by its file name, so each name is one file, and it is in tests/integration/."""
    from tests.conftest import MODULE_MARKERS

    registered = {line.split(":")[0].strip().strip('"') for line in
                  re.findall(r'"([a-z0-9_]+:[^"]*)"', (REPO / "pyproject.toml").read_text())}
    for marker, names in MODULE_MARKERS.items():
        assert marker in registered, marker
        for name in names:
            found = [p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob(f"{name}.py")]
            assert found == [f"tests/integration/{name}.py"], (name, found)
