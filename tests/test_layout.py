"""The repository layout DESIGN.md fixes, and the import hygiene it depends on."""

import ast
import importlib.util
import os
import sys
from pathlib import Path

from conftest import REPO

PACKAGES = ("strata", "pipelines", "train", "tune")
REQUIRED = ("pyproject.toml", "Makefile", "cluster.yaml", "platform", "strata", "pipelines", "train", "tune",
            "notebooks", "tests", "bench", "README.md", ".ci/run")


def test_required_paths_exist():
    missing = [p for p in REQUIRED if not (Path(REPO) / p).exists()]
    assert not missing, f"missing from the layout: {missing}"


def test_no_module_shadows_the_standard_library():
    """No top-level name of ours, and no module inside our packages run as scripts, is a stdlib name."""
    ours = {p.stem for p in Path(REPO).iterdir() if (p.is_dir() and not p.name.startswith(".")) or p.suffix == ".py"}
    clashes = sorted(ours & set(sys.stdlib_module_names) - {"platform"})  # platform/ holds no Python: see below
    assert not clashes, f"top-level names that shadow the standard library: {clashes}"
    for pkg in PACKAGES:
        for py in (Path(REPO) / pkg).rglob("*.py"):
            # `python -m pkg.mod` puts the repo root first on sys.path, never the package dir,
            # but a module named like a stdlib one still confuses readers and tools.
            assert py.stem not in sys.stdlib_module_names or py.stem in ("__init__", "__main__"), py


def test_platform_holds_no_python():
    platform_dir = Path(REPO) / "platform"
    py = [str(p) for p in platform_dir.rglob("*") if p.suffix in (".py", ".pyc") or p.name == "__init__.py"]
    assert not py, f"platform/ must hold deployment assets only, found {py}"
    import platform

    assert Path(platform.__file__).parent != platform_dir, "the stdlib platform module is shadowed"
    assert hasattr(platform, "python_version")


def test_packages_resolve_inside_the_repo():
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        assert spec is not None and spec.origin, f"{pkg} is not importable"
        assert Path(spec.origin).resolve().is_relative_to(Path(REPO).resolve()), \
            f"{pkg} resolves to {spec.origin}, outside the repo"


def _imports(pkg: str) -> set[str]:
    names = set()
    for py in (Path(REPO) / pkg).rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_imports_point_one_way():
    """strata imports none of the others; pipelines and train never import each other; tune may import train."""
    assert not _imports("strata") & {"pipelines", "train", "tune"}
    assert "train" not in _imports("pipelines") and "tune" not in _imports("pipelines")
    assert "pipelines" not in _imports("train") and "tune" not in _imports("train")
    assert "pipelines" not in _imports("tune")


def test_ci_runs_make_test():
    run = (Path(REPO) / ".ci" / "run").read_text()
    assert "make test" in run and os.access(Path(REPO) / ".ci" / "run", os.X_OK)
