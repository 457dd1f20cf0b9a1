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

REPO = Path(__file__).resolve().parents[1]
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


def test_every_module_sits_in_a_layer():
    """The contract cannot pass by omission: every module is inside one listed layer."""
    listed = [name for layer in layers() for name in layer]
    loose = [m for m in modules() if m not in PACKAGES and m != "aspo_lit.__init__"
             and not any(m == name or m.startswith(name + ".") for name in listed)]
    assert loose == [], f"modules outside every layer of .importlinter: {loose}"


def private_imports(path: Path, own: str) -> list[str]:
    """`from X import _name` where X is another project module (a private name across modules)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PACKAGES and node.module != own:
            found += [f"{path}:{node.lineno} {node.module}.{a.name}"
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_names_across_modules():
    found = [hit for name, path in modules().items() for hit in private_imports(path, name)]
    assert found == []


def test_private_import_check_sees_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from aspo_lit.figures import _float\n")
    (hit,) = private_imports(bad, "x")
    assert hit.endswith(":1 aspo_lit.figures._float")


def layout_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Layout"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def test_readme_layout_names_the_tree():
    """Every module file is named in README's layout block, and every file it names exists."""
    block = layout_block()
    named = set(re.findall(r"[\w-]+\.py\b", block))
    files = {path.name for path in modules().values() if path.name != "__init__.py"}
    assert sorted(files - named) == [], "modules missing from README's layout"
    assert sorted(named - files - {"setup_cpu.py", "gpu_check.py", "run.py"}) == [], \
        "README's layout names files that do not exist"
    folders = {path.parent.relative_to(REPO).as_posix() for path in modules().values()}
    for folder in folders:
        assert folder.split("/")[-1] + "/" in block, f"{folder}/ missing from README's layout"


def test_wheel_carries_the_configs(tmp_path):
    """A non-editable install (a wheel, no checkout around it) resolves `conf/...` to the configs
    shipped inside the package, so `python -m aspo_lit fit --config conf/aspo.yaml` works; it carries
    the shipped testbeds (their files matching their records) and references."""
    source = tmp_path / "source"   # a copy: setuptools writes build/ into the tree it builds
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in (*PACKAGES, "conf"):
        shutil.copytree(REPO / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, timeout=300,
                   capture_output=True)
    wheel = next((tmp_path / "dist").glob("aspo_lit-*.whl"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, timeout=300, capture_output=True)
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
    every marker it applies is registered; a renamed test file would otherwise drop silently into the fast set."""
    from tests.conftest import MODULE_MARKERS

    registered = {line.split(":")[0].strip().strip('"') for line in
                  re.findall(r'"([a-z0-9_]+:[^"]*)"', (REPO / "pyproject.toml").read_text())}
    for marker, names in MODULE_MARKERS.items():
        assert marker in registered, marker
        for name in names:
            assert (REPO / "tests" / f"{name}.py").is_file(), name
