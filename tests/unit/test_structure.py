"""The package's structure: which of disagg's parts import which (every import, at module level
or inside a function, read from the source with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

import disagg

ROOT = Path(disagg.__file__).parent


def _part(module: str) -> str:
    """``disagg.x.y`` -> ``x`` (a top-level module or package of disagg)."""
    return module.split(".")[1]


def _imports() -> dict[str, set[str]]:
    """Each part -> the parts of disagg its code imports."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        if len(rel.parts) < 2 or "_proto" in rel.parts:
            continue
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if name == "disagg":
            continue
        here = _part(name)
        package = name if rel.name == "__init__" else name.rsplit(".", 1)[0]
        targets = graph.setdefault(here, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mods = [".".join(base + ([node.module] if node.module else []))]
                else:
                    mods = [node.module or ""]
                if mods[0] == "disagg":  # from disagg import x: x is the part
                    mods = [f"disagg.{a.name}" for a in node.names]
            else:
                continue
            targets |= {_part(m) for m in mods if m.startswith("disagg.") and _part(m) != here}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_import_graph_of_disaggs_parts_has_no_circle():
    graph = _imports()
    assert {"rollout", "trainer", "transport", "pipeline", "sandbox", "tasks"} <= set(graph)
    assert "transport" in graph["trainer"]  # the walk sees imports inside functions too
    circle = _cycle(graph)
    assert circle is None, " -> ".join(circle)


def test_the_sandbox_is_its_own_part_that_tasks_and_tools_use():
    graph = _imports()
    assert graph["sandbox"] <= {"errors"}, graph["sandbox"]
    assert "sandbox" in graph["tasks"] and "sandbox" in graph["agent"]
    assert not list(ROOT.joinpath("tasks").glob("sandbox*.py"))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_a_reward_or_agent_worker_process_imports_neither_torch_nor_vllm():
    """Ray imports an actor's class by its module in a fresh worker process: a reward worker
    (``disagg.pipeline.rewards``) and an agent runner (``disagg.agent.runner``) need neither
    torch nor vLLM, and importing torch would cost each worker ~1.4 s and ~190 MB."""
    import subprocess
    import sys

    code = ("import sys, disagg.pipeline.rewards, disagg.agent.runner, disagg.pipeline as p; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)); "
            "p.Pipeline; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr  # the loop itself does import it


ENGINE_PACKAGES = {"vllm": "rollout/vllm/", "sglang": "rollout/sglang/", "sgl_kernel": "rollout/sglang/"}
"""Each inference engine's own package in disagg: the only code that imports it (issue 59's seam)."""
HARNESS = "bench/"
"""The benchmarks' harness may import an engine too: its plugin runs inside other frameworks' vLLM."""


def _engine_imports(root: Path = ROOT) -> list[tuple[str, int, str]]:
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                engine = mod.split(".")[0]
                if engine in ENGINE_PACKAGES and not rel.startswith((ENGINE_PACKAGES[engine], HARNESS)):
                    found.append((rel, node.lineno, mod))
    return found


def test_only_an_engines_own_package_imports_the_engine():
    assert _engine_imports() == [], "import vLLM only in disagg/rollout/vllm/, SGLang only in disagg/rollout/sglang/"


def test_the_engine_rule_catches_an_sglang_import_outside_its_package(tmp_path):
    """The rule reads SGLang's names too: ``import sglang`` or ``from sgl_kernel import`` (in a function
    too) anywhere else is found; inside SGLang's package it is not, nor is vLLM's there allowed."""
    files = {"rollout/pool_extra.py": "import sglang\n",
             "trainer/x.py": "def f():\n    from sgl_kernel import ops\n",
             "rollout/sglang/extra.py": "from sglang.srt.managers.io_struct import RpcReqInput\nimport vllm\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = sorted((rel, mod) for rel, _, mod in _engine_imports(tmp_path))
    assert found == [("rollout/pool_extra.py", "sglang"), ("rollout/sglang/extra.py", "vllm"),
                     ("trainer/x.py", "sgl_kernel")]
