"""04 started while 02 writes hidden/: the refusal quotes what 04 found missing whole, without the advice to run 02,
even where a path holds "; " (the message was cut at the first "; " before)."""

from common.hidden.shards import RERUN_02
from common.train.source import NO_HIDDEN_ADVICE, without_02_advice


def test_the_advice_to_run_02_is_cut_and_the_rest_kept_whole():
    index = "/runs/a; b/hidden/index.json"
    assert without_02_advice(f"{index} does not list shard-00003 yet; {RERUN_02}") == f"{index} does not list shard-00003 yet"
    assert without_02_advice(f"no hidden-state plan at /runs/x; y/hidden/plan.json{NO_HIDDEN_ADVICE}") == \
        "no hidden-state plan at /runs/x; y/hidden/plan.json"
    # a message with other advice is quoted as it is
    other = f"{index} lists no samples; check data/train.jsonl and {RERUN_02}"
    assert without_02_advice(other) == other
