"""The hidden-state shard format (common/hidden/shards.py): writer -> reader round trip, the
format_version check, and verification of damaged shards. No target model: the states are random."""

from __future__ import annotations

import json
import re
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from common.core.distributed import DistEnv
from common.core.errors import DataError
from common.core.run_folder import Layout
from common.hidden.index import build_index, index_header, read_entries, shard_entry, write_fragment, write_index
from common.hidden.shards import (
    FORMAT_VERSION,
    READ_VERSIONS,
    ShardReader,
    HiddenIndex,
    bytes_per_token,
    fp8_decode,
    fp8_encode,
    verify_entry,
    verify_shard_files,
    write_safetensors,
    write_shard,
)

AUX, H = [1, 2, 3], 8


def make_samples(n: int, seed: int, prefix: str) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = rng.randint(3, 12)
        samples.append({"id": f"{prefix}-{i}", "input_ids": [rng.randrange(100) for _ in range(length)],
                        "loss_mask": [int(rng.random() < 0.5) for _ in range(length)]})
    return samples


def make_states(samples: list[dict], seed: int, dtype=torch.bfloat16) -> list[dict]:
    """Two batches of random states whose rows follow the samples' tokens (as an extractor returns them)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(len(s["input_ids"]) for s in samples)
    aux, final = torch.randn(n, len(AUX) * H, generator=g).to(dtype), torch.randn(n, H, generator=g).to(dtype)
    cut = len(samples[0]["input_ids"])
    return [{"aux": aux[:cut], "final": final[:cut]}, {"aux": aux[cut:], "final": final[cut:]}]


def write_run(run_dir: Path, splits=(("train", 2), ("eval", 1)), storage: str = "full",
              ) -> tuple[Layout, dict[str, tuple[list[dict], list[dict]]]]:
    """Shards written the way 02 writes them (plan order, index after every shard). Returns the layout
    and {file: (samples, batches)}."""
    layout = Layout.of(run_dir)
    layout.hidden.mkdir(parents=True)
    settings = {"aux_layer_ids": AUX, "num_target_layers": 4, "target_hidden_size": H, "vocab_size": 100,
                "model_type": "llama", "dtype": "bfloat16", "target_dtype": "bfloat16",
                "storage": storage}
    header = index_header(settings, "tiny", {"train": {"file": "data/train.jsonl"}})
    plan_shards, written = [], {}
    for split, n_shards in splits:
        for _ in range(n_shards):
            k = len(plan_shards)
            samples = make_samples(4, seed=k, prefix=f"{split}{k}")
            plan_shards.append({"file": layout.shard(k).name, "split": split, "num_samples": len(samples),
                                "num_tokens": sum(len(s["input_ids"]) for s in samples),
                                "sample_ids": [s["id"] for s in samples]})
            written[plan_shards[-1]["file"]] = (samples, make_states(samples, seed=100 + k))
    entries = {}
    for shard in plan_shards:
        samples, batches = written[shard["file"]]
        entries[shard["file"]] = shard_entry(shard, write_shard(layout.hidden / shard["file"], samples, batches, storage))
        write_index(layout, build_index(header, plan_shards, entries))
    return layout, written


def test_write_safetensors_round_trip(tmp_path):
    a = torch.randn(5, 3).to(torch.bfloat16)
    b = torch.arange(7, dtype=torch.int64)
    path = tmp_path / "x.safetensors"
    sha, size = write_safetensors(path, [("a", [a[:2], a[2:]]), ("b", [b]), ("m", [torch.ones(3, dtype=torch.uint8)])])
    assert size == path.stat().st_size
    import hashlib

    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_file(path)
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b) and loaded["m"].tolist() == [1, 1, 1]
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_writer_then_reader_gives_the_same_tensors(tmp_path):
    layout, written = write_run(tmp_path / "run")
    raw = json.loads(layout.hidden_index.read_text())
    assert raw["format_version"] == FORMAT_VERSION and raw["complete"] and raw["num_shards"] == 3
    assert [s["file"] for s in raw["shards"]] == [p.name for p in layout.shard_files()]
    assert raw["bytes"] == sum(p.stat().st_size for p in layout.shard_files())

    index = HiddenIndex.load(layout.hidden_index)
    assert index.aux_layer_ids == AUX and index.target_hidden_size == H and index.dtype == "bfloat16"
    assert len(index.split_indices("train")) == 8 and len(index.split_indices("eval")) == 4
    reader = ShardReader(index)
    for i, ref in enumerate(index.samples):
        samples, batches = written[index.shards[ref.shard].file]
        j = [s["id"] for s in samples].index(ref.sample_id)
        start = sum(len(s["input_ids"]) for s in samples[:j])
        aux = torch.cat([b["aux"] for b in batches])[start:start + ref.length]
        final = torch.cat([b["final"] for b in batches])[start:start + ref.length]
        rows = reader.read([i])
        assert rows["input_ids"].tolist() == samples[j]["input_ids"] and rows["input_ids"].dtype == torch.int64
        assert rows["loss_mask"].tolist() == samples[j]["loss_mask"] and rows["loss_mask"].dtype == torch.uint8
        assert torch.equal(rows["aux_hidden"], aux) and torch.equal(rows["final_hidden"], final)
        assert torch.equal(reader.rows(i, "loss_mask", skip=2), rows["loss_mask"][2:])
    both = reader.read([0, len(index.samples) - 1])
    assert both["input_ids"].shape[0] == index.samples[0].length + index.samples[-1].length
    verify_shard_files(index, layout, DistEnv(), "sha256")  # the bytes match what the index recorded


def test_index_fragments_merge_with_the_index(tmp_path):
    layout, _ = write_run(tmp_path / "run")
    entries = read_entries(layout)
    assert sorted(entries) == [p.name for p in layout.shard_files()]
    extra = {**entries["shard-00000.safetensors"], "file": "shard-00009.safetensors"}
    write_fragment(layout, 1, [extra])
    assert layout.index_fragments() == [layout.index_fragment(1)]
    merged = read_entries(layout)
    assert set(merged) == set(entries) | {"shard-00009.safetensors"}
    assert read_entries(layout, fragments=False) == entries  # 04's view: what index.json lists


@pytest.mark.parametrize("version", [4, 0, None, "1"])
def test_an_index_in_another_format_version_is_one_clear_error(tmp_path, version):
    layout, _ = write_run(tmp_path / "run")
    raw = json.loads(layout.hidden_index.read_text())
    if version is None:
        del raw["format_version"]
    else:
        raw["format_version"] = version
    layout.hidden_index.write_text(json.dumps(raw))
    for read in (lambda: HiddenIndex.load(layout.hidden_index), lambda: read_entries(layout)):
        with pytest.raises(DataError) as e:
            read()
        msg = str(e.value)
        assert "\n" not in msg
        assert str(layout.hidden_index) in msg
        assert f"format_version {json.dumps(version)}" in msg  # the version found
        assert f"reads format_version {', '.join(map(str, READ_VERSIONS))}" in msg  # the versions supported
        assert "rerun 02_extract_hidden.py with --overwrite" in msg  # what to do


def test_earlier_format_versions_are_one_error_line(tmp_path):
    """One run-folder version: an index in format 1 or 2 (made by an earlier version) is not read through
    compatibility code but refused with one line that says so and how to rewrite it."""
    assert READ_VERSIONS == (FORMAT_VERSION,) == (3,)
    layout, _ = write_run(tmp_path / "run")
    raw = json.loads(layout.hidden_index.read_text())
    assert raw["format_version"] == 3 and raw["storage"] == "full"
    for version in (1, 2):
        layout.hidden_index.write_text(json.dumps({**raw, "format_version": version}))
        for read in (lambda: HiddenIndex.load(layout.hidden_index), lambda: read_entries(layout)):
            with pytest.raises(DataError, match=rf"^{re.escape(str(layout.hidden_index))} was made by an earlier version of "
                                                rf"this pipeline \(hidden-state format_version {version}, this code reads "
                                                rf"format_version 3\): rerun 02_extract_hidden.py with --overwrite"):
                read()


def test_fp8_shards_round_trip_and_cost_about_half_of_bf16(tmp_path):
    layout, written = write_run(tmp_path / "fp8", storage="fp8")
    raw = json.loads(layout.hidden_index.read_text())
    assert raw["storage"] == "fp8" and raw["bytes_per_token"] == bytes_per_token(3, H, "bfloat16", "fp8") == 4 * (H + 4) + 9
    with safe_open(str(layout.shard(0)), framework="pt") as f:
        assert f.get_slice("aux_hidden").get_dtype() == "F8_E4M3" and f.get_slice("final_hidden").get_dtype() == "F8_E4M3"
        assert f.get_slice("aux_scale").get_shape()[1] == 3 and f.get_slice("final_scale").get_shape()[1] == 1
    index = HiddenIndex.load(layout.hidden_index)
    reader = ShardReader(index)
    for i, ref in enumerate(index.samples):
        samples, batches = written[index.shards[ref.shard].file]
        j = [s["id"] for s in samples].index(ref.sample_id)
        start = sum(len(s["input_ids"]) for s in samples[:j])
        for name, key, parts in (("aux_hidden", "aux", 3), ("final_hidden", "final", 1)):
            x = torch.cat([b[key] for b in batches])[start:start + ref.length].float()
            q, scale = fp8_encode(x, parts)  # what the writer stored, decoded by hand
            expected = fp8_decode(q, scale, torch.bfloat16)
            got = reader.read([i], dtype=torch.bfloat16)[name]
            assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
            assert ((reader.read([i])[name] - x).abs() <= x.abs() * 2.0**-4 + 1e-6).all()
    verify_shard_files(index, layout, DistEnv(), "sha256")
    # at Kimi's width the scales are noise: fp8 is 50.04% of bf16
    assert bytes_per_token(3, 7168, "bfloat16", "fp8") / bytes_per_token(3, 7168, "bfloat16") < 0.5004


def test_fp8_codec_edges():
    x = torch.zeros(3, 2 * 4)
    x[1, :4] = torch.tensor([1e-30, -2e-30, 0.0, 3e-30])  # tiny values: their own scale, not flushed to 0
    x[2, 4:] = torch.tensor([1e4, -1e4, 5.0, 0.0])
    q, scale = fp8_encode(x, 2)
    y = fp8_decode(q, scale, torch.float32)
    assert torch.equal(y[0], x[0]) and (y[1, :4] != 0).sum() == 3 and y[2, 5] == -1e4 and y[2, 4] == 1e4
    assert ((y - x).abs() <= x.abs() * 2.0**-4).all()


def test_storage_and_shard_contents_must_agree(tmp_path):
    layout, _ = write_run(tmp_path / "run")  # full shards
    raw = json.loads(layout.hidden_index.read_text())
    # the advice is the least destructive that repairs it (issue 25, case 8): never --overwrite
    for storage, says, advice in (("fp8", "lacks tensors ['aux_scale', 'final_scale'] (index.json says storage fp8)",
                                   "and rerun 02_extract_hidden.py (it extracts that shard again and keeps the rest)"),
                                  ("int4", 'has storage "int4", this code reads full or fp8', "; rerun 02_extract_hidden.py (it rebuilds")):
        layout.hidden_index.write_text(json.dumps({**raw, "storage": storage}))
        with pytest.raises(DataError) as e:
            HiddenIndex.load(layout.hidden_index)
        assert says in str(e.value) and "\n" not in str(e.value) and advice in str(e.value) and "--overwrite" not in str(e.value)
    layout8, _ = write_run(tmp_path / "fp8", storage="fp8")
    raw8 = json.loads(layout8.hidden_index.read_text())
    layout8.hidden_index.write_text(json.dumps({**raw8, "storage": "full"}))
    with pytest.raises(DataError, match="holds F8_E4M3 states but index.json says storage full"):
        HiddenIndex.load(layout8.hidden_index)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_states_are_refused_by_the_writer(tmp_path, bad):
    samples = make_samples(2, seed=0, prefix="s")
    batches = make_states(samples, seed=1)
    batches[1]["final"][0, 3] = bad
    for storage in ("full", "fp8"):
        with pytest.raises(DataError, match="the target produced non-finite .* hidden states for shard-x.safetensors"):
            write_shard(tmp_path / "shard-x.safetensors", samples, batches, storage)
        assert not list(tmp_path.iterdir())  # nothing written, not even a temp file


def test_verify_catches_truncated_and_corrupted_shards(tmp_path):
    layout, _ = write_run(tmp_path / "run")
    entries = read_entries(layout)
    names = sorted(entries)
    index = HiddenIndex.load(layout.hidden_index)
    assert all(verify_entry(layout.hidden / n, entries[n], "sha256") is None for n in names)

    # corrupted: same size, other bytes -> only sha256 notices
    data = bytearray((layout.hidden / names[2]).read_bytes())
    data[-10] ^= 0xFF
    (layout.hidden / names[2]).write_bytes(bytes(data))
    assert verify_entry(layout.hidden / names[2], entries[names[2]], "sha256") == "sha256 mismatch (corrupted)"
    assert verify_entry(layout.hidden / names[2], entries[names[2]], "size") is None
    with pytest.raises(DataError, match=f"hidden shard .*{names[2]} does not match the sha256 02 recorded"):
        verify_shard_files(index, layout, DistEnv(), "sha256")
    verify_shard_files(index, layout, DistEnv(), "size")

    # truncated
    full = (layout.hidden / names[0]).read_bytes()
    (layout.hidden / names[0]).write_bytes(full[:1000])
    problem = verify_entry(layout.hidden / names[0], entries[names[0]], "size")
    assert problem == f"size 1000 != {len(full)} bytes (truncated or overwritten)"
    with pytest.raises(DataError, match=f"hidden shard .*{names[0]} has 1000 bytes but 02 wrote {len(full)}"):
        verify_shard_files(index, layout, DistEnv(), "size")
    with pytest.raises(DataError, match=f"hidden shard .*{names[0]} is truncated or corrupt"):
        HiddenIndex.load(layout.hidden_index)

    # missing
    (layout.hidden / names[1]).unlink()
    assert verify_entry(layout.hidden / names[1], entries[names[1]], "sha256") == "missing"
