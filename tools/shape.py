"""The shape of disagg's code, counted with ``ast`` (issue 60's limits): long functions, long
classes, wide signatures, how many files carry the armed sync's fields, where a manifest is cached,
mixins on the actors, benchmark-only methods on production actors.

    python tools/shape.py            # the report
    python tools/shape.py --check    # exit 1 if any count is over its limit

A manifest cache is a file that holds a manifest between syncs (an attribute ``_manifest`` set to
None, then filled; annotated or not); ``ManifestCache`` is the one meant to, and a file that makes
one is a manifest holder (``measure`` lists them; no limit). A production actor is ``EngineActor``,
``TrainerWorker``, or a class that subclasses one outside ``disagg/bench/`` (the benchmarks' own actors,
``disagg/bench/actors.py``, are not production's); its mixins are its other base classes. A
benchmark-only method is one of a production actor or of a base class of it whose name says so
(``bench``, ``peer``, ``trace_next``, ``replan``, ``next_push_as``, ``timed_``).
Counts are of ``disagg/`` as it is on disk; a function's or class's length is its lines from the
``def``/``class`` line (decorators excluded) to its last line, docstring included.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "disagg"
LIMITS = {"function_lines": 80, "class_lines": 400, "parameters": 8, "arm_field_files": 3, "manifest_caches": 1,
          "actor_mixins": 0, "bench_methods_on_actors": 0}
ARM_FIELDS = ("arm_id", "arm_timeout_s", "arm_header", "go_timeout_s", "header_first")
ACTORS = {"EngineActor", "TrainerWorker"}
BENCH_DIR = "disagg/bench/"  # the benchmarks' subclasses of the actors live here: not production actors
BENCH_WORDS = ("bench", "peer", "trace_next", "replan", "next_push_as", "timed_")


def _files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "_proto" not in p.parts)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return len([n for n in names if n not in ("self", "cls")])


def _classes() -> dict[str, ast.ClassDef]:
    return {n.name: n for p in _files() for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)}


def _bench_methods(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[str]:
    """Methods of ``cls`` and of its bases defined in disagg whose names say they serve a benchmark."""
    out = [f"{cls.name}.{f.name}" for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
           and any(w in f.name for w in BENCH_WORDS)]
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out += _bench_methods(classes[base.id], classes)
    return out


def _is_actor(cls: ast.ClassDef, rel: str) -> bool:
    """A production actor: one of ``ACTORS``, or a subclass of one in a file outside ``BENCH_DIR``."""
    return cls.name in ACTORS or (not rel.startswith(BENCH_DIR) and any(_is_actor_base(b) for b in cls.bases))


def _is_actor_base(base: ast.expr) -> bool:
    return isinstance(base, ast.Name) and base.id in ACTORS


def measure() -> dict:
    long_fns, long_classes, wide, arm_files, caches, holders, mixins, bench = [], [], [], set(), set(), set(), [], []
    classes = _classes()
    for path in _files():
        rel = path.relative_to(ROOT.parent).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        if any(f in text for f in ARM_FIELDS):
            arm_files.add(rel)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > LIMITS["function_lines"]:
                    long_fns.append((n, f"{rel}:{node.lineno} {node.name}"))
                if _params(node) > LIMITS["parameters"]:
                    wide.append((_params(node), f"{rel}:{node.lineno} {node.name}"))
            elif isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > LIMITS["class_lines"]:
                    long_classes.append((n, f"{rel}:{node.lineno} {node.name}"))
                if _is_actor(node, rel):
                    mixins += [f"{node.name}({ast.unparse(b)})" for b in node.bases if not _is_actor_base(b)]
                    bench += _bench_methods(node, classes)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # self._manifest = None: held between syncs
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Attribute) and t.attr in ("_manifest", "_manifests", "manifest_cache") \
                            and isinstance(node.value, ast.Constant) and node.value.value is None:
                        caches.add(rel)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ManifestCache":
                holders.add(rel)
    return {"function_lines": sorted(long_fns, reverse=True), "class_lines": sorted(long_classes, reverse=True),
            "parameters": sorted(wide, reverse=True), "arm_field_files": sorted(arm_files),
            "manifest_caches": sorted(caches), "manifest_holders": sorted(holders), "actor_mixins": mixins,
            "bench_methods_on_actors": bench}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if any count is over its limit")
    opts = parser.parse_args(argv)
    found = measure()
    over = []
    for key, limit in LIMITS.items():
        items = found[key]
        counted = len(items)
        bad = counted > limit if key in ("arm_field_files", "manifest_caches", "actor_mixins",
                                         "bench_methods_on_actors") else counted > 0
        print(f"{key} (limit {limit}): {counted}{'  OVER' if bad else ''}")
        for item in items:
            print(f"    {item[1]} ({item[0]})" if isinstance(item, tuple) else f"    {item}")
        if bad:
            over.append(key)
    return 1 if opts.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
