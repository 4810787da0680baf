"""The wire contract: committed stubs are fresh, and every RPC and field is documented."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "protos" / "specdec" / "v1").glob("*.proto"))


def test_committed_stubs_are_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = ROOT / "specdec" / "v1" / path.name
        assert committed.exists(), f"{path.name} is not committed: run python protos/generate.py"
        assert committed.read_bytes() == path.read_bytes(), f"{path.name} is stale: run python protos/generate.py"


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_rpc_and_field_has_a_comment(proto):
    lines = proto.read_text().splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        is_field = s.endswith(";") and "=" in s and not s.startswith(("syntax", "package", "option", "import"))
        if s.startswith("rpc ") or is_field:
            assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {s}"
