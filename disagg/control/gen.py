"""Generate the coordinator's gRPC stubs from ``protos/`` into ``disagg/control/_proto``.

The stubs are build outputs, never committed: ``setup.py`` calls ``generate``
at install time (``pip install .`` and ``pip install -e .``), and
``python -m disagg.control.gen`` regenerates them in place, which the Makefile
runs as a safety net after install.

protoc is run with ``-Iprotos`` so the descriptor keeps its canonical name
``disagg/v1/coordinator.proto``; the outputs are then moved flat into
``_proto`` with their imports rewritten, so the code imports
``from disagg.control._proto import coordinator_pb2``.

This module must import nothing but the standard library at module level:
``setup.py`` loads it by file path inside a build-isolation environment where
``disagg`` itself is not importable.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

# Protos compiled, relative to the proto root; their package is `disagg.v1`.
PROTO_FILES = ("disagg/v1/coordinator.proto",)
PROTO_PACKAGE_DIR = "disagg/v1"
STUB_PACKAGE = "disagg.control._proto"

_HERE = Path(__file__).resolve().parent
DEFAULT_PROTO_ROOT = _HERE.parent.parent / "protos"
DEFAULT_OUT_DIR = _HERE / "_proto"

_INIT_TEXT = '"""Generated gRPC stubs (see disagg/control/gen.py); never edit or commit."""\n'


def _rewrite(text: str) -> str:
    """Point imports and module names from ``disagg.v1`` at the flat stub package."""
    text = re.sub(r"^from disagg\.v1 import (\w+)", r"from . import \1", text, flags=re.M)
    # The message classes' __module__ (used by pickle and repr) must name the real module.
    return re.sub(r"'disagg\.v1\.(\w+_pb2)'", rf"'{STUB_PACKAGE}.\1'", text)


def generate(proto_root: Path = DEFAULT_PROTO_ROOT, out_dir: Path = DEFAULT_OUT_DIR) -> list[Path]:
    """Run protoc on ``PROTO_FILES`` and write the stubs into ``out_dir``; return the files.

    Each file is replaced atomically, so a process importing the stubs while
    they are regenerated sees either the old or the new file, never half of one.
    """
    proto_root, out_dir = Path(proto_root).resolve(), Path(out_dir).resolve()
    missing = [f for f in PROTO_FILES if not (proto_root / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"proto files {missing} not found under {proto_root}; "
            "run from a source checkout or pass --proto-root"
        )
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError(
            "generating the gRPC stubs needs grpcio-tools: pip install 'grpcio-tools>=1.70'"
        ) from e
    import importlib.resources

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="disagg-protoc-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTO_FILES,
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        outputs = sorted((Path(tmp) / PROTO_PACKAGE_DIR).glob("*_pb2*.py*"))
        if not outputs:
            raise RuntimeError(f"grpc_tools.protoc wrote no stubs into {tmp}/{PROTO_PACKAGE_DIR}")
        for src in outputs:
            written.append(_write_atomic(out_dir / src.name, _rewrite(src.read_text())))
    written.append(_write_atomic(out_dir / "__init__.py", _INIT_TEXT))
    # Stale bytecode of a previous generation must not shadow the new sources.
    shutil.rmtree(out_dir / "__pycache__", ignore_errors=True)
    return written


def _write_atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.control.gen", description=__doc__.splitlines()[0])
    parser.add_argument("--proto-root", type=Path, default=DEFAULT_PROTO_ROOT, help="directory holding disagg/v1/*.proto")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help="stub package directory to write")
    parser.add_argument("--no-check", action="store_true", help="skip importing the stubs with this interpreter's runtime")
    args = parser.parse_args(argv)
    files = generate(args.proto_root, args.out)
    for f in files:
        print(f"wrote {f}")
    if not args.no_check and args.out.resolve() == DEFAULT_OUT_DIR:
        # Import with this interpreter's protobuf and grpcio: the generated code
        # refuses a runtime older than the generator, and better here than in a run.
        importlib.invalidate_caches()
        for mod in ("coordinator_pb2", "coordinator_pb2_grpc"):
            importlib.import_module(f"{STUB_PACKAGE}.{mod}")
        import google.protobuf
        import grpc

        print(f"stubs import with protobuf {google.protobuf.__version__}, grpcio {grpc.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
