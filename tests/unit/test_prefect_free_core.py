"""The core package imports nothing from Prefect: flows/ and tasks/ are the only Prefect code."""

import ast
import subprocess
import sys
from pathlib import Path

import grpoflow

CORE = Path(grpoflow.__file__).parent


def test_no_module_of_the_core_names_prefect_in_an_import():
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            offenders += [
                f"{path.relative_to(CORE.parent)}:{node.lineno}" for n in names if n.split(".")[0] == "prefect"
            ]
    assert offenders == []


def test_importing_every_module_of_the_core_loads_no_prefect():
    code = (
        "import importlib, pkgutil, sys, grpoflow\n"
        "for m in pkgutil.walk_packages(grpoflow.__path__, 'grpoflow.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(len([m for m in sys.modules if m.startswith('grpoflow.')]), "
        "[m for m in sys.modules if m.split('.')[0] == 'prefect'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert int(out[0]) > 50 and out[1].strip() == "[]"


def test_a_prefect_home_under_a_new_dir_is_made_before_prefect_needs_it(tmp_path):
    import os

    home = tmp_path / "new" / "dirs" / ".prefect"
    env = {**os.environ, "PREFECT_HOME": str(home)}
    subprocess.run([sys.executable, "-c", "import flows"], env=env, check=True, cwd=Path(__file__).parents[2])
    assert home.is_dir()
