"""The packages' layer order (docs/design.md) holds for every import of every module, at the
top of a module and inside functions: a package imports only packages below it."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layer_order() -> list[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("<!-- layer order, lowest first")[1].split("<!-- end of layer order -->")[0]
    return re.findall(r"^\d+\. `(\w+)`", block, flags=re.M)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file, wherever it sits."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_the_layer_order_is_written_down():
    assert layer_order() == ["models", "kernels", "data", "export", "inference", "train"]


def test_every_import_goes_down_the_layers():
    order = layer_order()
    rank = {name: i for i, name in enumerate(order)}
    against = []
    for package in order:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, imported in imports_of(path):
                if imported in rank and rank[imported] > rank[package]:
                    against.append(f"{path.relative_to(ROOT)}:{line} imports {imported} ({package} sits below it)")
    assert not against, "\n".join(against)


def test_the_walk_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from train.run import run\n    import inference.runtime.engine\n")
    assert imports_of(module) == [(1, "os"), (4, "train"), (5, "inference")]
