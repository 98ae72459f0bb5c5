"""The protos pass ``buf lint``, keep buf's canonical format, and stay wire compatible.

The breaking-change check compares the protos in the working tree with their previous
version in git history (WIRE_JSON rules, ``protos/buf.yaml``):

- protos edited but not committed: the previous version is HEAD's;
- otherwise: the version before the newest commit that changed a ``.proto`` file.

That baseline is extracted with ``git archive`` and built into an image with buf, then
``buf breaking protos --against IMAGE``. Versions from before ``protos/`` became the proto
root import each other as ``protos/baton/v1/...``; those are built with the repository
root as their root instead. WIRE_JSON rules compare types by their full names
(``baton.v1.SamplingParameters``), not by file path, so both layouts compare exactly.

Without the baseline in history (a shallow clone) the test is skipped and says how to
fetch it; ``test_breaking_rules_catch_a_wire_break`` checks the rules themselves with no
history at all. buf comes from PyPI's ``buf-bin`` (the dev extra) and needs no network.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROTOS = REPO / "protos"
PROTO_PATHSPEC = "protos/*.proto"  # git pathspec: `*` also matches `/`


def buf_binary() -> str:
    """The buf next to this interpreter (a venv's bin/), else the one on PATH."""
    beside = Path(sys.executable).parent / "buf"
    if beside.exists():
        return str(beside)
    found = shutil.which("buf")
    if found is None:
        pytest.fail("buf is not installed: pip install buf-bin (it is in the dev extra)")
    return found


def run_buf(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([buf_binary(), *args], cwd=cwd, capture_output=True, text=True)


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def previous_protos_ref() -> tuple[str, str]:
    """(git revision, why that one) of the protos' previous version; skips without git."""
    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: no history to compare the protos with")
    edited = git("status", "--porcelain", "--", PROTO_PATHSPEC).stdout.strip()
    if edited:
        return "HEAD", f"uncommitted .proto edits ({edited.splitlines()[0].strip()}, ...)"
    newest = git("log", "-n1", "--format=%H", "--", PROTO_PATHSPEC).stdout.strip()
    assert newest, "no commit ever touched protos/*.proto"
    parent = git("rev-parse", "--verify", "--quiet", f"{newest}^").stdout.strip()
    if not parent:
        shallow = git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
        if shallow:
            pytest.skip(
                f"shallow clone: the protos before {newest[:12]} are not in local history; "
                "`git fetch --unshallow` to run the wire-compatibility check"
            )
        pytest.skip(f"{newest[:12]} introduced the protos: there is no earlier version")
    return parent, f"the version before {newest[:12]}, the newest commit that changed them"


def build_image(ref: str, out: Path) -> str:
    """Build ``ref``'s protos into the image ``out``; returns which root was used."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "protos"], cwd=REPO, capture_output=True
    )
    assert archive.returncode == 0, archive.stderr.decode(errors="replace")
    tree = out.parent / "baseline"
    tree.mkdir()
    with tarfile.open(fileobj=BytesIO(archive.stdout), mode="r:") as tar:
        tar.extractall(tree, filter="data")
    if (tree / "protos" / "buf.yaml").exists():
        root, how = tree / "protos", "protos/ as the proto root"
    else:
        root, how = tree, "the repository root (its imports read protos/baton/v1/...)"
    built = run_buf("build", str(root), "-o", str(out), cwd=out.parent)
    assert built.returncode == 0, f"could not build the baseline ({how}):\n{built.stderr}"
    return how


def test_buf_lint() -> None:
    done = run_buf("lint", "protos")
    assert done.returncode == 0, f"buf lint protos:\n{done.stdout}{done.stderr}"


def test_buf_format() -> None:
    done = run_buf("format", "--diff", "--exit-code", "protos")
    assert done.returncode == 0, f"run `buf format -w protos`:\n{done.stdout}{done.stderr}"


def test_wire_compatible_with_the_previous_protos(tmp_path: Path) -> None:
    ref, why = previous_protos_ref()
    image = tmp_path / "previous.binpb"
    how = build_image(ref, image)
    done = run_buf("breaking", "protos", "--against", str(image))
    assert done.returncode == 0, (
        f"buf breaking against {ref} ({why}; built with {how}):\n{done.stdout}{done.stderr}"
    )


def test_breaking_rules_catch_a_wire_break(tmp_path: Path) -> None:
    """The rules bite: retyping a field and renaming another (its JSON name) is refused."""
    image = tmp_path / "current.binpb"
    assert run_buf("build", str(PROTOS), "-o", str(image), cwd=tmp_path).returncode == 0
    changed = tmp_path / "changed"
    shutil.copytree(PROTOS, changed, ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    common = changed / "baton" / "v1" / "common.proto"
    text = common.read_text()
    assert "optional uint32 max_tokens = 1;" in text
    common.write_text(
        text.replace("optional uint32 max_tokens = 1;", "optional string max_tokens = 1;")
    )
    generate = changed / "baton" / "v1" / "generate.proto"
    text = generate.read_text()
    assert "string model_id = 1;" in text
    generate.write_text(text.replace("string model_id = 1;", "string model_name = 1;"))
    done = run_buf("breaking", str(changed), "--against", str(image), cwd=tmp_path)
    assert done.returncode != 0
    assert 'changed type from "uint32" to "string"' in done.stdout
    assert 'changed name from "model_id" to "model_name"' in done.stdout


def test_language_options_are_set_in_every_file() -> None:
    """Each file carries the same options, so generated code lands in one package per
    language whichever file a generator starts from."""
    expected = {
        "csharp_namespace": '"Baton.V1"',
        "go_package": '"baton/gen/go/baton/v1;batonv1"',
        "java_multiple_files": "true",
        "java_package": '"com.baton.v1"',
        "objc_class_prefix": '"BXX"',
        "php_namespace": '"Baton\\\\V1"',
        "ruby_package": '"Baton::V1"',
    }
    for proto in sorted(PROTOS.glob("baton/v1/*.proto")):
        options = {}
        for line in proto.read_text().splitlines():
            if line.startswith("option "):
                name, _, value = line.removeprefix("option ").rstrip(";").partition(" = ")
                options[name] = value
        outer = "".join(part.capitalize() for part in proto.stem.split("_")) + "Proto"
        assert options == {**expected, "java_outer_classname": f'"{outer}"'}, proto.name
