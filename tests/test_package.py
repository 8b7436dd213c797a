"""The installed package: its version is written once, its metadata agrees, it
ships its license and its type-annotation marker, and the source tree cannot
stand in for it."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax_tiled


def test_version_is_single_sourced():
    """pyproject.toml reads the version from jax_tiled/__init__.py."""
    assert importlib.metadata.version("jax_tiled") == jax_tiled.__version__


def test_license_is_shipped():
    files = importlib.metadata.files("jax_tiled") or []
    assert any(f.name == "LICENSE" for f in files), files


def test_type_annotations_are_shipped():
    """py.typed marks the package as typed (PEP 561) for type checkers."""
    files = importlib.metadata.files("jax_tiled") or []
    assert any(f.name == "py.typed" for f in files), files


ROOT = Path(__file__).resolve().parent.parent


def _python(*args: str) -> subprocess.CompletedProcess:
    """Python started in the repository root, as the README's commands are."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_source_tree_is_not_imported_by_accident():
    """From the repository root, plain `python` finds the uncompiled source tree
    first: importing it fails at once and says what to do; `python -P` (the
    README's commands) imports the installed package."""
    if not (ROOT / "jax_tiled" / "__init__.py").exists():
        pytest.skip("not run from a checkout")
    if Path(jax_tiled.__file__).resolve().parent == ROOT / "jax_tiled":
        pytest.skip("an editable install imports the source tree on purpose")
    plain = _python(
        "-c",
        "import sys\ntry:\n import jax_tiled\nexcept ImportError as e:\n"
        " print(e)\n print('jax imported:', 'jax' in sys.modules)",
    )
    assert plain.returncode == 0, plain.stderr
    assert "pip install ." in plain.stdout and "python -P" in plain.stdout, plain.stdout
    assert plain.stdout.strip().endswith("jax imported: False"), plain.stdout  # at once
    safe = _python("-P", "-c", "import jax_tiled; print(jax_tiled.__file__)")
    assert safe.returncode == 0, safe.stderr
    assert Path(safe.stdout.strip()).resolve() == Path(jax_tiled.__file__).resolve()


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules that `module` (at `path`) imports, at any depth of
    its code: inside functions and `if TYPE_CHECKING:` blocks too. `from p
    import m` imports module p.m where there is one, else p's own names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module} imports relatively"  # the package does not
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in modules
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in modules and name != module)
    return found


def test_no_import_cycle_among_the_package_modules():
    root = Path(jax_tiled.__file__).parent
    files = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: _imports(p, m, set(files)) for m, p in files.items()}
    assert graph["jax_tiled._matmul"] >= {"jax_tiled._dot_general", "jax_tiled._checks"}
    state: dict[str, str] = {}

    def visit(module, trail):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycle = trail[trail.index(imported) :] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, [*trail, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
