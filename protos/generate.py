"""Generate the Python stubs for protos/specdec/v1/*.proto into specdec/v1/.

Usage: python protos/generate.py [OUT_DIR]   (OUT_DIR defaults to the repository root)
The stubs are committed; tests/test_protos.py fails when they are stale.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PROTO_DIR.glob("specdec/v1/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "specdec" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path)
