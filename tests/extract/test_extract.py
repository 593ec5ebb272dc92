"""Stage 02: hidden-state extraction on tiny random Llama / Qwen3 / DeepSeek-V3 (MLA + MoE) targets.

The reference is always the real transformers model with output_hidden_states=True: aux id k must be
hidden_states[k] (the residual stream after k layers) and final_hidden hidden_states[N] (after the
final norm). Resume tests SIGKILL real subprocesses and compare shard bytes.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.core.config import config_from_dict
from common.core.errors import ConfigError, DataError
from common.extract.hf_backend import make_batches
from common.extract.stage import check_disk_space, run_extraction
from common.hidden.shards import bytes_per_token
from tests.helpers import (REPO, VOCAB, build_target, error_line, kill_while_working, stage_env, start_in_own_group,
                           write_yaml)

PYTHON = sys.executable


# ---------------------------------------------------------------------------------------------
# Helpers: tiny random targets, tokenized data, configs
# ---------------------------------------------------------------------------------------------


def write_data(run_dir: Path, n_train: int = 24, n_eval: int = 6, seed: int = 0, lengths=(4, 70)) -> None:
    rng = random.Random(seed)
    data = run_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("eval", n_eval)):
        with open(data / f"{split}.jsonl", "w") as f:
            for i in range(n):
                length = rng.randint(*lengths)
                row = {"id": f"{split}-{i:03d}", "input_ids": [rng.randrange(VOCAB) for _ in range(length)],
                       "loss_mask": [int(rng.random() < 0.6) for _ in range(length)]}
                f.write(json.dumps(row) + "\n")


def read_rows(run_dir: Path) -> dict[str, dict]:
    rows = {}
    for split in ("train", "eval"):
        path = run_dir / "data" / f"{split}.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                rows[row["id"]] = {**row, "split": split}
    return rows


def make_cfg(run_dir: Path, model: Path, aux=(1, 2, 3), **extract):
    tree = {"run_dir": str(run_dir), "target": {"model": str(model), "aux_layer_ids": list(aux), "dtype": "bfloat16"},
            "extract": {"shard_max_tokens": 300, "batch_max_tokens": 160, "device": "cpu", "backend": "hf", **extract}}
    return tree


def cfg_of(tree: dict, **target):
    tree = json.loads(json.dumps(tree))
    tree["target"].update(target)
    return config_from_dict(tree)


def shard_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "hidden").glob("shard-*.safetensors"))}


def stage_cmd(cfg_path: Path, *extra: str) -> list[str]:
    """02 on this config, in a subprocess (stage_env: one thread, as in this process -> byte-identical shards)."""
    return [PYTHON, str(REPO / "02_extract_hidden.py"), "--config", str(cfg_path), *extra]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: 1 intra-op thread avoids OpenMP oversubscription
    (measured 40 ms vs 0.05 ms per tiny linear under load), and in-process and subprocess runs
    use the same thread count, so their shards are byte-identical."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("llama") / "model", "llama")


# ---------------------------------------------------------------------------------------------
# Correctness against output_hidden_states
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,aux", [("llama", (1, 2, 3)), ("qwen3", (0, 2, 3)), ("deepseek_v3", (0, 1, 3))])
def test_matches_output_hidden_states(tmp_path, family, aux):
    """fp32 target: every stored row equals the unbatched HF reference (padding does not leak)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_target(tmp_path / "model", family, dtype=torch.float32)
    run_dir = tmp_path / "run"
    write_data(run_dir, n_train=10, n_eval=3)
    cfg = cfg_of(make_cfg(run_dir, model_dir, aux, dtype="float32"), dtype="float32")
    summary = run_extraction(cfg)
    assert summary["complete"]

    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    assert index["complete"] and index["aux_layer_ids"] == list(aux) and index["target_hidden_size"] == 64
    assert index["num_target_layers"] == 4 and index["dtype"] == "float32"
    rows = read_rows(run_dir)
    assert sorted(i for s in index["shards"] for i in s["sample_ids"]) == sorted(rows)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for shard in index["shards"]:
        t = load_file(run_dir / "hidden" / shard["file"])
        assert t["aux_hidden"].shape == (shard["num_tokens"], 3 * 64) and t["aux_hidden"].dtype == torch.float32
        assert t["final_hidden"].shape == (shard["num_tokens"], 64)
        assert t["input_ids"].dtype == torch.int64 and t["loss_mask"].dtype == torch.uint8
        off = t["sample_offsets"].tolist()
        assert off[0] == 0 and off[-1] == shard["num_tokens"] and len(off) == len(shard["sample_ids"]) + 1
        for i, sid in enumerate(shard["sample_ids"]):
            row = rows[sid]
            assert row["split"] == shard["split"]
            assert t["input_ids"][off[i]:off[i + 1]].tolist() == row["input_ids"]
            assert t["loss_mask"][off[i]:off[i + 1]].tolist() == row["loss_mask"]
            with torch.no_grad():
                hs = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
            ref_aux = torch.cat([hs[k][0] for k in aux], dim=-1)
            torch.testing.assert_close(t["aux_hidden"][off[i]:off[i + 1]], ref_aux, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(t["final_hidden"][off[i]:off[i + 1]], hs[4][0], atol=2e-5, rtol=1e-4)
    # Samples are sorted longest first within a shard.
    for shard in index["shards"]:
        lengths = [len(rows[s]["input_ids"]) for s in shard["sample_ids"]]
        assert lengths == sorted(lengths, reverse=True)


def test_bf16_rows_equal_hf_on_the_same_padded_batch(tmp_path, llama_bf16):
    """bf16: the hooks store exactly the tensors HF returns for the same batch (bitwise)."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    write_data(run_dir, n_train=8, n_eval=0)
    cfg = cfg_of(make_cfg(run_dir, llama_bf16, (1, 2, 3)))
    run_extraction(cfg)
    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    rows = read_rows(run_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_bf16, dtype=torch.bfloat16).eval()
    for shard in index["shards"]:
        t = load_file(run_dir / "hidden" / shard["file"])
        samples = [rows[s]["input_ids"] for s in shard["sample_ids"]]
        got, pos = 0, 0
        for lo, hi in make_batches([len(s) for s in samples], cfg.extract.batch_max_tokens):
            width = max(len(s) for s in samples[lo:hi])
            ids = torch.zeros(hi - lo, width, dtype=torch.long)
            mask = torch.zeros(hi - lo, width, dtype=torch.long)
            for r, s in enumerate(samples[lo:hi]):
                ids[r, :len(s)] = torch.tensor(s)
                mask[r, :len(s)] = 1
            with torch.no_grad():
                hs = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            keep = mask.bool()
            ref_aux = torch.cat([hs[k][keep] for k in (1, 2, 3)], dim=-1)
            n = ref_aux.shape[0]
            assert torch.equal(t["aux_hidden"][pos:pos + n], ref_aux)
            assert torch.equal(t["final_hidden"][pos:pos + n], hs[4][keep])
            pos += n
            got += 1
        assert pos == shard["num_tokens"] and got >= 1


def test_fp8_storage_is_the_float32_states_within_e4m3_rounding(tmp_path, capsys):
    """extract.storage fp8 on a float32 target: the planner prints the fp8 bytes/token, the shards hold
    that many bytes per token, and 04's reader decodes every state to the float32 one within e4m3's
    rounding (half a unit in the last of 3 mantissa bits: 2^-4 relative; 2^-10 x scale near zero)."""
    from common.hidden.shards import HiddenIndex, ShardReader

    model_dir = build_target(tmp_path / "model", "llama", dtype=torch.float32)
    states = {}
    for storage in ("full", "fp8"):
        run_dir = tmp_path / storage
        write_data(run_dir, n_train=10, n_eval=3)
        run_extraction(cfg_of(make_cfg(run_dir, model_dir, dtype="float32", storage=storage), dtype="float32"))
        index = HiddenIndex.load(run_dir / "hidden" / "index.json")
        assert index.storage == storage
        per_token = bytes_per_token(3, 64, "float32", storage)
        for info in index.shards:  # data = tokens x bytes/token + the sample offsets; the rest is the header
            n_samples = len(info.sample_ids)
            data = info.path.stat().st_size - 8 - int.from_bytes(info.path.read_bytes()[:8], "little")
            assert data == info.num_tokens * per_token + 8 * (n_samples + 1)
        reader = ShardReader(index)
        states[storage] = {ref.sample_id: reader.read([i]) for i, ref in enumerate(index.samples)}
    printed = capsys.readouterr().out
    assert "x 281 B/token ((3 aux + final) x (H 64 x 1 B fp8 + 4 B scale) + 9 B ids/mask)" in printed
    assert "x 1,033 B/token ((3 aux + final) x H 64 x 4 B float32 + 9 B ids/mask)" in printed
    assert states["full"].keys() == states["fp8"].keys()
    for sid, full in states["full"].items():
        fp8 = states["fp8"][sid]
        assert torch.equal(fp8["input_ids"], full["input_ids"]) and torch.equal(fp8["loss_mask"], full["loss_mask"])
        for name, parts in (("aux_hidden", 3), ("final_hidden", 1)):
            x, y = full[name], fp8[name]
            assert y.dtype == torch.float32 and y.shape == x.shape
            amax = x.view(len(x), parts, 64).abs().amax(-1, keepdim=True).expand(-1, -1, 64).reshape(x.shape)
            bound = torch.maximum(x.abs() * 2.0**-4, amax / 448 * 2.0**-10) * 1.0001
            assert ((y - x).abs() <= bound).all(), (sid, name, ((y - x).abs() / bound).max())
            assert not torch.equal(y, x)  # it was stored in fp8, not passed through


def test_kimi_bytes_per_token_and_batches():
    assert bytes_per_token(3, 7168, "bfloat16") == 57_344 + 9  # 3 aux + final, H 7168, bf16, + ids/mask
    assert bytes_per_token(3, 7168, "bfloat16", "fp8") == 4 * (7168 + 4) + 9  # 50.04% of bf16
    lengths = [90, 70, 70, 40, 30, 10, 5]
    batches = make_batches(lengths, 160)
    assert batches == [(0, 1), (1, 3), (3, 7)]
    for lo, hi in batches:
        assert (hi - lo) * max(lengths[lo:hi]) <= 160
    assert make_batches([500, 20], 160) == [(0, 1), (1, 2)]  # one over-budget sample gets its own batch


# ---------------------------------------------------------------------------------------------
# Resume, integrity, overwrite
# ---------------------------------------------------------------------------------------------


def test_sigkill_at_random_points_then_resume_is_byte_identical(tmp_path, llama_bf16):
    # ~15 shards of several forward passes each (~0.1 s a shard here): a kill point is passed by a shard or
    # less before the kill, however late the poll comes
    run_dir = tmp_path / "run"
    write_data(run_dir, n_train=260, n_eval=52, lengths=(20, 120))
    tree = make_cfg(run_dir, llama_bf16, (1, 2, 3), shard_max_tokens=1700, batch_max_tokens=256)
    cfg_path = write_yaml(tmp_path / "run.yaml", tree)

    # Reference: one uninterrupted run (in this process: same CPU kernels and thread count).
    ref_dir = tmp_path / "ref"
    write_data(ref_dir, n_train=260, n_eval=52, lengths=(20, 120))
    assert run_extraction(config_from_dict({**tree, "run_dir": str(ref_dir)}))["complete"]
    reference = shard_bytes(ref_dir)
    ref_index = json.loads((ref_dir / "hidden" / "index.json").read_text())
    assert ref_index["complete"] and len(reference) >= 12

    hidden = run_dir / "hidden"

    def shards_on_disk(victim=None) -> int:
        return len(list(hidden.glob("shard-*"))) if hidden.exists() else 0

    def nothing_half_written(killed: list) -> None:
        """Never a half-written shard under its final name: every indexed shard is a finished one."""
        print(f"{'killed' if killed else 'finished'} with {shards_on_disk()}/{len(reference)} shards on disk")
        index = json.loads((hidden / "index.json").read_text()) if (hidden / "index.json").is_file() else {"shards": []}
        for entry in index["shards"]:
            assert reference[entry["file"]] == (hidden / entry["file"]).read_bytes()
        for name in (p.name for p in hidden.glob("shard-*")):
            assert (hidden / name).read_bytes() == reference[name]

    # Three kills, each once a number of shards drawn from those still to write (but the last) exists, plus a
    # random 0-80 ms (so some kills land inside a forward pass, some inside a shard write or index update).
    kills = kill_while_working(lambda: start_in_own_group(stage_cmd(cfg_path)), shards_on_disk, len(reference) - 1,
                               random.Random(1234), kills=3, jitter_s=0.08, after_each=nothing_half_written)
    assert kills == 3, "the runs finished before they could be killed; make the test data larger"

    final = subprocess.run(stage_cmd(cfg_path), capture_output=True, text=True, env=stage_env(), cwd=REPO)
    assert final.returncode == 0, final.stderr
    assert shard_bytes(run_dir) == reference
    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    assert index["complete"] and index["shards"] == ref_index["shards"]
    assert not list((run_dir / "hidden").glob(".tmp-*"))
    assert run_extraction(config_from_dict(tree))["status"] == "complete"


def test_missing_truncated_and_corrupted_shards_are_recomputed(tmp_path, llama_bf16, capsys):
    run_dir = tmp_path / "run"
    write_data(run_dir)
    cfg = cfg_of(make_cfg(run_dir, llama_bf16))
    run_extraction(cfg)
    reference = shard_bytes(run_dir)
    assert len(reference) >= 4
    hidden = run_dir / "hidden"
    names = sorted(reference)
    (hidden / names[0]).write_bytes(reference[names[0]][:1000])  # truncated
    (hidden / names[1]).unlink()  # missing
    corrupted = bytearray(reference[names[2]])
    corrupted[-10] ^= 0xFF  # same size, different content
    (hidden / names[2]).write_bytes(bytes(corrupted))
    capsys.readouterr()
    summary = run_extraction(cfg)
    out = capsys.readouterr().out
    assert f"{names[0]} is size 1000" in out and "truncated" in out
    assert f"{names[1]} is missing" in out
    assert f"{names[2]} is sha256 mismatch" in out
    assert summary["shards"] == 3 and summary["complete"]
    assert shard_bytes(run_dir) == reference


def test_04_checks_the_shards_02_wrote_without_reading_them_again(tmp_path, llama_bf16, monkeypatch):
    """02 hashes each shard while writing it; it records that hash where 04's shard check looks
    (stages/hashes.json, by size and mtime), so 04's first start does not read every shard again (hours at
    Kimi scale). A shard rewritten afterwards has a new mtime and is read and caught."""
    import common.core.run_folder as run_folder
    from common.core.distributed import DistEnv
    from common.core.run_folder import Layout
    from common.hidden.shards import HiddenIndex, verify_shard_files

    run_dir = tmp_path / "run"
    write_data(run_dir)
    cfg = cfg_of(make_cfg(run_dir, llama_bf16))
    run_extraction(cfg)
    layout = Layout.of(cfg)
    index = HiddenIndex.load(layout.hidden_index)
    assert len(index.shards) >= 4
    read = []
    real_sha256 = run_folder.file_sha256
    monkeypatch.setattr(run_folder, "file_sha256", lambda path, **kw: read.append(Path(path).name) or real_sha256(path, **kw))
    verify_shard_files(index, layout, DistEnv(), "sha256")
    assert read == []  # every shard's hash came from 02
    damaged = bytearray(index.shards[1].path.read_bytes())
    damaged[-10] ^= 0xFF
    index.shards[1].path.write_bytes(bytes(damaged))
    with pytest.raises(DataError, match="does not match the sha256 02 recorded"):
        verify_shard_files(index, layout, DistEnv(), "sha256")
    assert read == [index.shards[1].file]


def test_inputs_changed_needs_overwrite_and_overwrite_restarts(tmp_path, llama_bf16, capsys):
    run_dir = tmp_path / "run"
    write_data(run_dir)
    cfg = cfg_of(make_cfg(run_dir, llama_bf16))
    run_extraction(cfg)
    capsys.readouterr()
    run_extraction(cfg)
    assert "already complete" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"other inputs or settings \(aux_layer_ids: \[1, 2, 3\] -> \[0, 1, 2\]\).*--overwrite"):
        run_extraction(cfg_of(make_cfg(run_dir, llama_bf16, (0, 1, 2))))
    write_data(run_dir, seed=1)  # different samples
    with pytest.raises(DataError, match=r"data/train.jsonl changed.*--overwrite"):
        run_extraction(cfg)
    summary = run_extraction(cfg, overwrite=True)
    assert summary["complete"]
    index = json.loads((run_dir / "hidden" / "index.json").read_text())
    assert sorted(i for s in index["shards"] for i in s["sample_ids"]) == sorted(read_rows(run_dir))


# ---------------------------------------------------------------------------------------------
# Refusals and input errors
# ---------------------------------------------------------------------------------------------


def test_disk_space_refusal_cli(tmp_path, llama_bf16):
    run_dir = tmp_path / "run"
    write_data(run_dir)
    cfg_path = write_yaml(tmp_path / "run.yaml", make_cfg(run_dir, llama_bf16))
    res = subprocess.run(stage_cmd(cfg_path, "--set", "extract.min_free_disk_gb=1e6"), capture_output=True, text=True,
                         env=stage_env(), cwd=REPO)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: not enough disk space") and "missing" in res.stderr
    assert res.stderr.strip().count("\n") == 0
    assert "B/token" in res.stdout and "needed" in res.stdout
    assert not list((run_dir / "hidden").glob("shard-*"))


def test_disk_space_check_numbers(tmp_path):
    class Usage:
        free = 10_000_000_000

    check_disk_space(tmp_path, 8_999_999_999, 1.0, disk_usage=lambda p: Usage)
    # the shards and the head-room must both fit: 9.5 GB + 1 GB > 10 GB free
    with pytest.raises(DataError, match=r"need 9.50 GB for the shards \+ 1.00 GB head-room \(extract.min_free_disk_gb=1\) = 10.50 GB, "
                                        r"free 10.00 GB; 500.00 MB missing"):
        check_disk_space(tmp_path, 9_500_000_000, 1.0, disk_usage=lambda p: Usage)


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_refused_overwrite_leaves_hidden_and_the_manifest_as_they_were(tmp_path, llama_bf16):
    """Every refusal 02 can make comes before --overwrite deletes anything: a budget too small for the new plan,
    not enough free disk for its shards (counting what the deletion frees), a bad sample in the inputs. Each is
    exit 2 with one error line, and hidden/ and 02's manifest stay byte-identical."""
    run_dir = tmp_path / "run"
    write_data(run_dir)
    cfg_path = write_yaml(tmp_path / "run.yaml", make_cfg(run_dir, llama_bf16))
    run_extraction(cfg_of(make_cfg(run_dir, llama_bf16)))
    manifest = run_dir / "stages" / "02_extract_hidden.json"
    before, record = tree_bytes(run_dir / "hidden"), manifest.read_bytes()
    assert len(before) >= 6

    for override, says in (("extract.max_disk_gb=0.00001", "extract.max_disk_gb=1e-05 cannot hold the eval shards"),
                           ("extract.min_free_disk_gb=1e6", "not enough disk space in")):
        res = subprocess.run(stage_cmd(cfg_path, "--overwrite", "--set", override), capture_output=True, text=True,
                             env=stage_env(), cwd=REPO)
        error_line(res, says)
        assert tree_bytes(run_dir / "hidden") == before and manifest.read_bytes() == record, override

    with open(run_dir / "data" / "train.jsonl", "a") as f:  # a new sample the new plan refuses
        f.write(json.dumps({"id": "foreign", "input_ids": [1, 2, VOCAB + 5], "loss_mask": [1, 1, 1]}) + "\n")
    with pytest.raises(DataError, match="sample 'foreign' has token id"):
        run_extraction(cfg_of(make_cfg(run_dir, llama_bf16)), overwrite=True)
    assert tree_bytes(run_dir / "hidden") == before and manifest.read_bytes() == record


def test_what_a_killed_run_left_is_removed_by_a_rerun_that_has_nothing_to_extract(tmp_path, llama_bf16, capsys):
    """A run killed after its last shard leaves the vllm backend's request directory and temp files; the next run
    finds everything extracted, starts no engine, and still removes them (the SIGKILL of a real vllm-backend 02:
    test_extract_vllm_backend.py)."""
    run_dir = tmp_path / "run"
    write_data(run_dir)
    cfg = cfg_of(make_cfg(run_dir, llama_bf16))
    run_extraction(cfg)
    hidden = run_dir / "hidden"
    shards = shard_bytes(run_dir)
    (hidden / "vllm-requests.rank-00000.tmp").mkdir()
    (hidden / "vllm-requests.rank-00000.tmp" / "x3.safetensors.partial").write_bytes(b"0" * 100)
    (hidden / "vllm-requests.rank-00001.tmp").mkdir()  # from a run with more ranks
    (hidden / ".tmp-index.json.abc123").write_text("{")
    capsys.readouterr()
    assert run_extraction(cfg)["status"] == "complete"
    assert "already complete" in capsys.readouterr().out
    assert sorted(p.name for p in hidden.iterdir()) == sorted([*shards, "index.json", "plan.json"])
    assert shard_bytes(run_dir) == shards


def test_input_errors(tmp_path, llama_bf16):
    run_dir = tmp_path / "run"
    cfg = cfg_of(make_cfg(run_dir, llama_bf16))
    with pytest.raises(DataError, match="train.jsonl not found; run 01b_generate_synthetic.py first"):
        run_extraction(cfg)
    write_data(run_dir, n_train=3, n_eval=0)
    with open(run_dir / "data" / "train.jsonl", "a") as f:
        f.write(json.dumps({"id": "foreign", "input_ids": [1, 2, VOCAB + 5], "loss_mask": [1, 1, 1]}) + "\n")
    with pytest.raises(DataError, match=f"sample 'foreign' has token id {VOCAB + 5}, outside the target vocab"):
        run_extraction(cfg)
    write_data(run_dir, n_train=3, n_eval=0)
    with open(run_dir / "data" / "eval.jsonl", "w") as f:
        f.write(json.dumps({"id": "long", "input_ids": [1] * 600, "loss_mask": [1] * 600}) + "\n")
    with pytest.raises(DataError, match="sample 'long' has 600 tokens, more than the target's max_position_embeddings 512"):
        run_extraction(cfg)
    (run_dir / "data" / "eval.jsonl").unlink()
    with pytest.raises(ConfigError, match="out of range"):
        run_extraction(cfg_of(make_cfg(run_dir, llama_bf16, (1, 2, 4))))
    with pytest.raises(ConfigError, match="duplicat"):
        run_extraction(cfg_of(make_cfg(run_dir, llama_bf16, (1, 1, 3))))
    with pytest.raises(ConfigError, match="not ascending"):
        run_extraction(cfg_of(make_cfg(run_dir, llama_bf16, (3, 1, 2))))
    assert not (run_dir / "hidden" / "plan.json").exists()


def test_missing_train_cli_one_line(tmp_path, llama_bf16):
    cfg_path = write_yaml(tmp_path / "run.yaml", make_cfg(tmp_path / "run", llama_bf16))
    res = subprocess.run(stage_cmd(cfg_path), capture_output=True, text=True, env=stage_env(), cwd=REPO)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "run 01b_generate_synthetic.py first" in res.stderr


# ---------------------------------------------------------------------------------------------
# Multi-process (torchrun, gloo on CPU): disjoint shards per rank, merged index, same bytes
# ---------------------------------------------------------------------------------------------


def test_torchrun_two_ranks_match_single_process(tmp_path, llama_bf16):
    single = tmp_path / "single"
    write_data(single, n_train=20, n_eval=4)
    run_extraction(cfg_of(make_cfg(single, llama_bf16)))  # 1 thread, like each torchrun rank
    reference = shard_bytes(single)
    ref_index = json.loads((single / "hidden" / "index.json").read_text())

    multi = tmp_path / "multi"
    write_data(multi, n_train=20, n_eval=4)
    cfg_path = write_yaml(tmp_path / "multi.yaml", make_cfg(multi, llama_bf16))
    # --standalone: torchrun's rendezvous binds a port of its own choosing (nothing to pick that another could take)
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "02_extract_hidden.py"), "--config", str(cfg_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=stage_env(), cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    index = json.loads((multi / "hidden" / "index.json").read_text())
    assert index["complete"] and index["shards"] == ref_index["shards"]
    assert not list((multi / "hidden").glob("index.rank-*.json"))  # fragments merged and removed
    assert shard_bytes(multi) == reference


def test_changed_target_weights_stop_02_and_04(tmp_path):
    """The target's model.safetensors swapped for other weights of the same shapes: 02 and 04 (even with
    --overwrite, which would train the new lm_head on the old states) stop with one line until 02 re-extracts."""
    from safetensors.torch import save_file

    from tests.helpers import base_config, error_line, make_target, run_stage, structured_samples
    from common.core.io import write_jsonl_atomic

    target = make_target(tmp_path / "target")
    run_dir = tmp_path / "run"
    write_jsonl_atomic(run_dir / "data" / "train.jsonl", structured_samples(12, 1, "tr"))
    write_jsonl_atomic(run_dir / "data" / "eval.jsonl", structured_samples(4, 2, "ev"))
    cfg = write_yaml(tmp_path / "run.yaml", base_config(run_dir, target, max_steps=2, eval_every=0, checkpoint_every=2))
    for script in ("02_extract_hidden.py", "03_build_vocab_map.py"):
        assert run_stage(script, cfg).returncode == 0
    shards = {p.name: p.read_bytes() for p in (run_dir / "hidden").glob("shard-*")}
    weights = target / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: (v * 1.5).contiguous() for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})

    error_line(run_stage("02_extract_hidden.py", cfg), "target weights changed", "--overwrite")
    for args in ((), ("--overwrite",)):
        error_line(run_stage("04_train.py", cfg, *args), "extracted from other target weights",
                   "rerun 02_extract_hidden.py --overwrite")
    assert {p.name: p.read_bytes() for p in (run_dir / "hidden").glob("shard-*")} == shards  # nothing rewritten
    assert not (run_dir / "train" / "final").exists()
    # re-extracted from the new weights, training goes on
    assert run_stage("02_extract_hidden.py", cfg, "--overwrite").returncode == 0
    assert {p.name: p.read_bytes() for p in (run_dir / "hidden").glob("shard-*")} != shards
    assert run_stage("04_train.py", cfg, "--overwrite").returncode == 0


def test_a_moved_run_and_target_rewrite_nothing_and_a_finished_04_stays_complete(tmp_path, capsys):
    """Issue 33, case 11: the run folder and target.model moved to other paths, same files. 02's no-op rerun rewrote
    hidden/index.json (its header names the target's path) and a finished 04 then refused ("hidden/index.json
    changed"): moving a target forced a retrain. Now each stage is complete and rewrites nothing; 01b's tokenizer is
    the same one by content."""
    import shutil

    from common.core.config import load_config
    from common.core.io import write_jsonl_atomic
    from common.core.run_folder import Layout
    from common.target.loading import tokenizer_fingerprint
    from common.vocab.vocab_map import run_vocab_map
    from tests.helpers import base_config, make_target, run_stage, structured_samples

    target = make_target(tmp_path / "target")
    run_dir = tmp_path / "run"
    write_jsonl_atomic(run_dir / "data" / "train.jsonl", structured_samples(12, 1, "tr"))
    write_jsonl_atomic(run_dir / "data" / "eval.jsonl", structured_samples(4, 2, "ev"))
    train = {"max_steps": 2, "eval_every": 0, "checkpoint_every": 2}
    cfg = write_yaml(tmp_path / "run.yaml", base_config(run_dir, target, **train))
    run_extraction(load_config(cfg))
    run_vocab_map(load_config(cfg))
    assert run_stage("04_train.py", cfg).returncode == 0
    watched = [run_dir / "hidden" / "index.json", run_dir / "hidden" / "plan.json", run_dir / "vocab" / "report.json",
               run_dir / "train" / "final" / "model.safetensors"]

    def state() -> list:
        return [(p.read_bytes(), p.stat().st_mtime_ns) for p in watched]

    before = state()
    tokenizer = tokenizer_fingerprint(Layout(run_dir), str(target))
    moved, moved_run = tmp_path / "elsewhere" / "target", tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    shutil.move(target, moved)
    shutil.move(run_dir, moved_run)
    watched = [moved_run / p.relative_to(run_dir) for p in watched]
    run_dir = moved_run
    cfg = write_yaml(tmp_path / "run.yaml", base_config(run_dir, moved, **train))
    capsys.readouterr()
    assert run_extraction(load_config(cfg))["status"] == "complete"
    run_vocab_map(load_config(cfg))
    out = capsys.readouterr().out
    assert "02_extract_hidden: already complete" in out and "03_build_vocab_map: already complete" in out
    res = run_stage("04_train.py", cfg)
    assert res.returncode == 0 and "04_train: already complete" in res.stdout, res.stderr[-3000:]
    assert state() == before
    assert tokenizer_fingerprint(Layout(run_dir), str(moved)) == tokenizer != str(target)
