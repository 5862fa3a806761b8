"""The packages import one way: bench / dashboard / infra -> stream -> personalization ->
simulator -> engine. An import that runs back up (at module level or inside a function) fails
here, naming the file and line, so the layering holds as the code grows."""

import ast
import os
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = {
    "engine": 0,
    "simulator": 1,
    "personalization": 2,
    "stream": 3,
    "bench": 4,
    "dashboard": 4,
    "infra": 4,
}
# among the top layer, only the benchmarks use infra (to start the services they measure)
ALLOWED_SIDEWAYS = {("bench", "infra")}


def imports(path: str):
    """(line, top-level package) of every import in the file, function-level ones included."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def upward_imports(root: str = ROOT) -> list[str]:
    bad = []
    for pkg, rank in RANK.items():
        for d, _, files in os.walk(os.path.join(root, pkg)):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                for line, dep in imports(path):
                    if dep not in RANK or dep == pkg:
                        continue
                    if RANK[dep] > rank or (
                        RANK[dep] == rank and (pkg, dep) not in ALLOWED_SIDEWAYS
                    ):
                        bad.append(f"{os.path.relpath(path, root)}:{line}: {pkg} imports {dep}")
    return bad


def test_no_import_runs_back_up():
    bad = upward_imports()
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_check_catches_an_upward_import(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text("def f():\n    from stream.worker import W\n")
    assert upward_imports(str(tmp_path)) == ["engine/x.py:2: engine imports stream"]


def test_no_two_modules_share_a_name():
    names: dict[str, list[str]] = {}
    for p in RANK:
        for d, _, files in os.walk(os.path.join(ROOT, p)):
            for f in files:
                if f.endswith(".py") and f != "__init__.py":
                    names.setdefault(f, []).append(os.path.relpath(os.path.join(d, f), ROOT))
    clash = {n: ps for n, ps in names.items() if len(ps) > 1}
    assert not clash, clash


def test_tests_mirror_the_packages_and_import_no_test_module():
    """Each test lives under tests/<package>/ (or tests/ for the whole repository); what tests
    share lives in tests/testkit, so no test module imports another test module or a conftest."""
    tests = os.path.join(ROOT, "tests")
    allowed = {*RANK, "testkit", "data"}
    bad = []
    for d, dirs, files in os.walk(tests):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        rel = os.path.relpath(d, tests)
        if rel != "." and rel.split(os.sep)[0] not in allowed:
            bad.append(f"tests/{rel}: not a package of the repository")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            for line, dep in imports(path):
                if dep.startswith("test_") or dep == "conftest":
                    bad.append(f"{os.path.relpath(path, ROOT)}:{line}: imports {dep}")
    assert not bad, "\n".join(bad)
