"""Every name a script imports from a sibling script or from hf_kbit exists, including the imports inside
functions, which run only on a GPU (trace_gemv.trace_shape's) and so would fail first there."""

from __future__ import annotations

import ast
import importlib

import pytest
from conftest import SCRIPTS

SCRIPT_MODULES = {p.stem for p in SCRIPTS.glob("*.py")}


def imported_names(path):
    """(module, name, line) of each `from module import name` in the file, at any depth, for modules of
    the project: sibling scripts and hf_kbit."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module in SCRIPT_MODULES or node.module.split(".")[0] == "hf_kbit"):
            for alias in node.names:
                yield node.module, alias.name, node.lineno


@pytest.mark.parametrize("script", sorted(SCRIPT_MODULES))
def test_every_project_name_a_script_imports_exists(script):
    missing = []
    for module, name, line in imported_names(SCRIPTS / f"{script}.py"):
        mod = importlib.import_module(module)
        if name != "*" and not hasattr(mod, name):
            try:  # a submodule: `from hf_kbit.eval import report`
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"line {line}: from {module} import {name}")
    assert not missing, f"scripts/{script}.py imports names that do not exist: {missing}"
