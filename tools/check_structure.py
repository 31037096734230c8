"""Structure checks of the product code (the top-level scripts and the sdxl_trainer package), run
by `make lint`: imports flow one way (scripts → package, no cycles, counting imports inside
functions too), no function takes more than MAX_PARAMETERS parameters or spans more than
MAX_FUNCTION_LINES lines, and the training loop stays short enough to read at once.

    python tools/check_structure.py          # exit 1 and one line per problem, else silent
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "sdxl_trainer"
MAX_PARAMETERS = 8  # beyond this a function wants a small dataclass
MAX_FUNCTION_LINES = 70
TRAIN_LOOP = ("train_sdxl.py", "train")
MAX_TRAIN_LINES, MAX_STEP_LOOP_LINES = 90, 40


def product_files(root: Path) -> dict[str, Path]:
    """Module name → file, for the top-level scripts and every module of the package."""
    files = {path.stem: path for path in sorted(root.glob("*.py"))}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def imported_modules(name: str, path: Path, tree: ast.Module, known: set[str]) -> set[str]:
    """The product modules `name` imports anywhere in its file (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports a module; `from module import name` a name in it.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def import_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = [f"{module} imports the top-level script {target}"
                for module, targets in sorted(graph.items()) if module.startswith(PACKAGE)
                for target in sorted(targets) if not target.startswith(PACKAGE)]
    problems += [f"import cycle: {' -> '.join([*cycle, cycle[0]])}" for cycle in find_cycles(graph)]
    return problems


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def function_problems(path: Path, tree: ast.Module) -> list[str]:
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        arguments = node.args
        names = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]
        names += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
        count = len([name for name in names if name not in ("self", "cls")])
        where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}()"
        if count > MAX_PARAMETERS:
            problems.append(f"{where} takes {count} parameters (at most {MAX_PARAMETERS}: use a dataclass)")
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
            problems.append(f"{where} is {lines} lines long (at most {MAX_FUNCTION_LINES})")
    return problems


def train_loop_problems(trees: dict[str, ast.Module]) -> list[str]:
    """`train()` reads top to bottom: at most MAX_TRAIN_LINES lines, its step loop MAX_STEP_LOOP_LINES."""
    file_name, function_name = TRAIN_LOOP
    tree = trees.get(Path(file_name).stem)
    train = next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                  and node.name == function_name), None) if tree else None
    if train is None:
        return [f"{file_name}: no function {function_name}()"]
    problems = []
    lines = train.end_lineno - train.lineno + 1
    if lines > MAX_TRAIN_LINES:
        problems.append(f"{file_name} {function_name}() is {lines} lines long (at most {MAX_TRAIN_LINES})")
    loops = [node for node in ast.walk(train) if isinstance(node, ast.While | ast.For)]
    outermost = min(loops, key=lambda node: node.lineno, default=None)
    if outermost is None:
        problems.append(f"{file_name} {function_name}() has no step loop")
    elif outermost.end_lineno - outermost.lineno + 1 > MAX_STEP_LOOP_LINES:
        problems.append(f"{file_name} {function_name}()'s step loop is "
                        f"{outermost.end_lineno - outermost.lineno + 1} lines long (at most {MAX_STEP_LOOP_LINES})")
    return problems


def check(root: Path = ROOT) -> list[str]:
    files = product_files(root)
    trees = {name: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for name, path in files.items()}
    graph = {name: imported_modules(name, files[name], tree, set(files)) for name, tree in trees.items()}
    problems = import_problems(graph)
    for name, tree in trees.items():
        problems += function_problems(files[name], tree)
    return problems + train_loop_problems(trees)


def main() -> int:
    problems = check()
    for problem in problems:
        print(f"structure: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
