"""The committed generated modules are exactly what the committed .proto files produce."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from protos import generate

REGENERATE = f"run `{generate.REGENERATE_COMMAND}` from the repository root and commit the result"


def test_there_are_protos_and_generated_modules() -> None:
    protos = generate.proto_files()
    assert protos, "no .proto files found"
    committed = generate.generated_files(generate.REPO_ROOT)
    for proto in protos:
        stem = proto.stem
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            expected = proto.with_name(f"{stem}{suffix}")
            assert expected in committed, f"{expected} is missing; {REGENERATE}"


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    committed = generate.generated_files(generate.REPO_ROOT)
    assert committed == fresh, (
        f"generated file set differs: committed-only {sorted(set(committed) - set(fresh))}, "
        f"missing {sorted(set(fresh) - set(committed))}; {REGENERATE}"
    )
    stale = [
        str(rel)
        for rel in fresh
        if (tmp_path / rel).read_bytes() != (generate.REPO_ROOT / rel).read_bytes()
    ]
    assert not stale, f"stale generated modules {stale}; {REGENERATE}"


@pytest.mark.parametrize("module", ["common", "generate", "kv", "worker"])
def test_generated_modules_import(module: str) -> None:
    # Also proves the protobuf runtime accepts the committed gencode version.
    importlib.import_module(f"protos.baton.v1.{module}_pb2")
    importlib.import_module(f"protos.baton.v1.{module}_pb2_grpc")


@pytest.mark.parametrize("module", ["common", "generate", "kv", "worker"])
def test_generated_modules_use_the_proto_root_and_the_repository_import_path(module: str) -> None:
    """Descriptors name files from the proto root (``baton/v1/x.proto``, as other
    languages' generators and reflection clients see them), while the Python modules
    import each other, and report their classes, under ``protos.baton.v1``."""
    pb2 = importlib.import_module(f"protos.baton.v1.{module}_pb2")
    assert pb2.DESCRIPTOR.name == f"baton/v1/{module}.proto"
    assert all(dep.name.startswith("baton/v1/") for dep in pb2.DESCRIPTOR.dependencies)
    for message in pb2.DESCRIPTOR.message_types_by_name:
        assert getattr(pb2, message).__module__ == f"protos.baton.v1.{module}_pb2"
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
        source = (generate.REPO_ROOT / generate.PROTO_DIR / f"{module}{suffix}").read_text()
        assert not re.search(r"^(from|import) baton\b", source, re.MULTILINE), suffix


def test_rewrite_points_protoc_imports_at_protos() -> None:
    source = (
        "from baton.v1 import common_pb2 as baton_dot_v1_dot_common__pb2\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'baton.v1.kv_pb2', _globals)\n"
    )
    assert generate.rewrite_imports(source) == (
        "from protos.baton.v1 import common_pb2 as baton_dot_v1_dot_common__pb2\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'protos.baton.v1.kv_pb2', _globals)\n"
    )


def _screaming(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).upper()


@pytest.mark.parametrize("module", ["common", "generate", "kv", "worker"])
def test_proto_style(module: str) -> None:
    """STYLE.md rule 18: baton.v1, enum values prefixed with their type, *_UNSPECIFIED = 0."""
    file = importlib.import_module(f"protos.baton.v1.{module}_pb2").DESCRIPTOR
    assert file.package == "baton.v1"
    enums = list(file.enum_types_by_name.values())
    for message in file.message_types_by_name.values():
        enums.extend(message.enum_types)
    for enum in enums:
        prefix = _screaming(enum.name) + "_"
        assert enum.values[0].name == prefix + "UNSPECIFIED" and enum.values[0].number == 0
        assert all(v.name.startswith(prefix) for v in enum.values), enum.name


@pytest.mark.parametrize("proto", generate.proto_files(), ids=lambda p: p.name)
def test_every_field_and_enum_value_has_a_comment(proto: Path) -> None:
    """A field or enum value line must follow a ``//`` comment line (or carry one)."""
    declaration = re.compile(r"^\s*(optional\s+|repeated\s+)?[\w.]+(\s+\w+)?\s*=\s*\d+\s*;")
    previous = ""
    undocumented = []
    for number, line in enumerate((generate.REPO_ROOT / proto).read_text().splitlines(), 1):
        stripped = line.strip()
        if declaration.match(line) and not previous.startswith("//") and "//" not in line:
            undocumented.append(f"{proto}:{number}: {stripped}")
        if stripped:
            previous = stripped
    assert undocumented == []
