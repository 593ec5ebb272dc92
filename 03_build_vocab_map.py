"""Stage 03: build the draft vocabulary map from the loss-masked tokens of data/train.jsonl.

Keeps the vocab.draft_vocab_size most frequent target token ids at loss-masked (assistant)
positions of the training split (eval is not counted), sorted by id. Writes, under run_dir/vocab/:
  vocab_map.safetensors  d2t int64 [V_d] (target id = i + d2t[i]) and t2d bool [V]
  report.json            draft/target vocab sizes, distinct ids seen, coverage of the training
                         tokens, ids padded in when fewer distinct ids were seen
Rerunning with the same inputs says "already complete"; --overwrite rebuilds.
"""

from common.core.cli import stage_main


def run(cfg, args):
    from common.vocab.vocab_map import run_vocab_map

    run_vocab_map(cfg, overwrite=args.overwrite)
    return 0


if __name__ == "__main__":
    stage_main("03_build_vocab_map", __doc__, run)
