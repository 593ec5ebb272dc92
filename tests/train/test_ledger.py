"""The sample ledger (common.train.ledger): counts per sample and epoch, its JSON round trip, equality, and the
one-line report of whether every sample was trained exactly once per epoch."""

import numpy as np

from common.train.ledger import SampleLedger


def test_records_counts_per_sample_and_epoch_and_reports_them():
    ledger = SampleLedger(["a", "b", "c"])
    assert ledger.describe() == "ledger: nothing trained yet"
    ledger.record_ids(0, ["c", "a", "b"])
    ledger.record_ids(1, ["b"])
    ledger.record(1, [0, 2])  # by position into sample_ids
    assert [c.tolist() for c in ledger.epochs] == [[1, 1, 1], [1, 1, 1]]
    assert ledger.times_trained().tolist() == [2, 2, 2]
    assert ledger.describe() == "ledger: every one of 3 train samples trained exactly 2 time(s); per epoch 3/3, 3/3"
    assert ledger.summary() == {"num_samples": 3, "epochs": 2, "min_times": 2, "max_times": 2, "per_epoch_trained": [3, 3]}


def test_a_sample_trained_twice_or_never_shows_in_the_report():
    ledger = SampleLedger(["a", "b", "c"])
    ledger.record_ids(0, ["a", "a", "b"])  # "a" twice, "c" never
    assert ledger.epochs[0].tolist() == [2, 1, 0]
    assert ledger.describe() == "ledger: train samples trained 0 to 2 times; per epoch 2/3 (1 twice or more)"
    assert ledger.summary()["min_times"] == 0 and ledger.summary()["max_times"] == 2


def test_a_later_epoch_alone_leaves_earlier_epochs_at_zero():
    ledger = SampleLedger(["a", "b"])
    ledger.record_ids(2, ["b"])
    assert [c.tolist() for c in ledger.epochs] == [[0, 0], [0, 0], [0, 1]]
    assert ledger.epochs[0].dtype == np.int32


def test_json_round_trip_and_equality(tmp_path):
    ledger = SampleLedger(["x", "y"])
    ledger.record_ids(0, ["y", "x"])
    path = tmp_path / "ledger.json"
    path.write_text(ledger.to_json())
    loaded = SampleLedger.from_file(path)
    assert loaded == ledger and loaded.sample_ids == ["x", "y"]
    loaded.record_ids(0, ["x"])
    assert loaded != ledger  # one more count
    assert SampleLedger(["x", "y"]) != SampleLedger(["y", "x"])  # another order is another ledger
    assert ledger != {"sample_ids": ["x", "y"]}
