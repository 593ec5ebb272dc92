"""hidden/index.json, its rank fragments and consumed.json (common/hidden/index.py): what 02 records after each
shard under torchrun against one process, and 04's record of the rounds it trained. No shards: the entries are
made up (their bytes are common/hidden/shards.py's, tested in test_shards.py)."""

from __future__ import annotations

import json

import pytest

from common.core.distributed import DistEnv
from common.core.errors import ConfigError, DataError
from common.core.run_folder import Layout
from common.hidden.index import (
    build_index,
    drop_fragments,
    index_header,
    json_text,
    mark_trained,
    merge_index,
    read_consumed,
    read_entries,
    record_entries,
    write_consumed,
)
from common.hidden.rounds import HiddenPlan

SETTINGS = {"aux_layer_ids": [1, 2, 3], "num_target_layers": 4, "target_hidden_size": 8, "vocab_size": 100,
            "model_type": "llama", "dtype": "bfloat16", "target_dtype": "bfloat16", "storage": "full"}


def plan_shards(n: int) -> list[dict]:
    return [{"file": f"shard-{k:05d}.safetensors", "split": "eval" if k == n - 1 else "train", "num_samples": 2,
             "num_tokens": 10 + k, "sample_ids": [f"s{k}a", f"s{k}b"]} for k in range(n)]


def entry(shard: dict) -> dict:
    return {**shard, "sha256": f"{shard['num_tokens']:064x}", "bytes": 1000 + shard["num_tokens"], "num_loss_tokens": 3}


def test_two_ranks_record_the_index_one_process_records(tmp_path):
    """Shard k goes to rank k % 2: each rank records its own in its fragment, rank 0 merges them into index.json
    after each of its shards and once more after the barrier; the result is the bytes one process writes."""
    header = index_header(SETTINGS, "tiny", {"train": {"file": "data/train.jsonl"}})
    shards = plan_shards(4)
    one = Layout.of(tmp_path / "one")
    one.hidden.mkdir(parents=True)
    known: dict[str, dict] = {}
    for s in shards:
        known[s["file"]] = entry(s)
        record_entries(one, DistEnv(), header, shards, dict(known), known)
    assert one.index_fragments() == []  # one process writes no fragments

    two = Layout.of(tmp_path / "two")
    two.hidden.mkdir(parents=True)
    mine = {0: {}, 1: {}}
    seen = {0: {}, 1: {}}  # each process's own view
    for k, s in enumerate(shards):
        rank = k % 2
        mine[rank][s["file"]] = seen[rank][s["file"]] = entry(s)
        record_entries(two, DistEnv(rank=rank, world_size=2), header, shards, mine[rank], seen[rank])
    assert two.index_fragments() == [two.index_fragment(0), two.index_fragment(1)]
    assert json.loads(two.index_fragment(1).read_text()) == {"rank": 1, "shards": [entry(shards[1]), entry(shards[3])]}
    # rank 0's last merge came before rank 1's last shard: index.json lacks it until the merge after the barrier
    assert set(read_entries(two, fragments=False)) == {s["file"] for s in shards[:3]}
    assert set(read_entries(two)) == {s["file"] for s in shards}

    index = merge_index(two, header, shards)
    assert index["complete"] and index == build_index(header, shards, known)
    assert two.hidden_index.read_bytes() == one.hidden_index.read_bytes() == json_text(index).encode()
    drop_fragments(two)
    assert two.index_fragments() == [] and read_entries(two) == known


def test_every_plan_has_rounds_and_only_an_unbudgeted_one_grows_or_keeps_its_shards(tmp_path):
    """Without a budget a plan's rounds are its epochs, each over every train shard (in plan order), one more per
    add_epoch (train.max_steps past train.epochs), and marking one trained records and deletes nothing; a
    budgeted plan has exactly 02's rounds: more is one ConfigError line."""
    layout = Layout.of(tmp_path / "run")
    layout.hidden.mkdir(parents=True)
    shards = [{**s, "lengths": [4, 6 + k]} for k, s in enumerate(plan_shards(4))]
    plan = HiddenPlan({"shards": shards}, epochs=2)
    train = ("shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors")
    assert not plan.budgeted and [(r.number, r.epoch, r.shards) for r in plan.rounds] == [(0, 0, train), (1, 1, train)]
    assert plan.add_epoch().shards == train and len(plan.rounds) == 3 and plan.describe_round(2) == "epoch 3"
    assert plan.round_samples(1) == (["s0a", "s0b", "s1a", "s1b", "s2a", "s2b"], [4, 6, 4, 7, 4, 8])
    assert plan.due_files(set()) == [s["file"] for s in shards]  # 02: everything, in plan order
    for s in shards:
        (layout.hidden / s["file"]).write_bytes(b"x")
    mark_trained(layout, plan, {0, 1})
    assert not layout.hidden_consumed.exists() and len(layout.shard_files()) == 4

    budgeted = HiddenPlan({"shards": shards, "settings": {"epochs": 1}, "rounds": [
        {"epoch": 0, "shards": list(train), "num_samples": 6, "num_tokens": 33, "bytes": 1}]})
    assert budgeted.budgeted and len(budgeted.rounds) == 1
    with pytest.raises(ConfigError, match=r"^one more epoch is more than the 1 rounds 02 planned for train.epochs=1; "
                                          r"lower train.max_steps, or raise train.epochs and rerun 02_extract_hidden.py "
                                          r"--overwrite \(it plans the rounds again\)$"):
        budgeted.add_epoch()


def test_consumed_rounds_are_recorded_then_their_shards_deleted(tmp_path):
    layout = Layout.of(tmp_path / "run")
    layout.hidden.mkdir(parents=True)
    plan = HiddenPlan({"shards": plan_shards(5), "rounds": [
        {"epoch": 0, "shards": ["shard-00000.safetensors", "shard-00001.safetensors"], "num_samples": 4, "num_tokens": 21, "bytes": 1},
        {"epoch": 0, "shards": ["shard-00002.safetensors"], "num_samples": 2, "num_tokens": 12, "bytes": 1},
        {"epoch": 1, "shards": ["shard-00003.safetensors"], "num_samples": 2, "num_tokens": 13, "bytes": 1}]})
    for s in plan.shards:
        (layout.hidden / s["file"]).write_bytes(b"x")
    assert read_consumed(layout) == set()  # no consumed.json yet

    mark_trained(layout, plan, {1})
    mark_trained(layout, plan, {0})
    assert layout.hidden_consumed.read_text() == '{"rounds":[0,1]}\n'  # compact, sorted
    assert read_consumed(layout) == {0, 1}
    assert sorted(p.name for p in layout.shard_files()) == ["shard-00003.safetensors", "shard-00004.safetensors"]

    mark_trained(layout, plan, set(), keep_out={1})  # a resumed checkpoint before round 1: it is extracted again
    assert read_consumed(layout) == {0}
    write_consumed(layout, [])  # 04 --overwrite
    assert read_consumed(layout) == set() and layout.hidden_consumed.read_text() == '{"rounds":[]}\n'
    assert not list(layout.hidden.glob(".tmp-*"))  # atomic writes leave no temp files

    layout.hidden_consumed.write_text("{not json")
    with pytest.raises(DataError, match="consumed.json is unreadable.*rerun 04_train.py"):
        read_consumed(layout)
