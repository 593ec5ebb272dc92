"""Stage 02: run the target over every tokenized sample and store the hidden states the draft trains on.

Reads data/train.jsonl and data/eval.jsonl (from 01b_generate_synthetic.py) and the target model
(target.model, in target.dtype). Writes, under run_dir/hidden/:
  shard-NNNNN.safetensors  per token: input_ids, loss_mask, aux_hidden (the residual stream after
                           each of target.aux_layer_ids decoder layers, vLLM convention, concatenated),
                           final_hidden (final-norm output = lm_head input); sample_offsets
  index.json               per shard: split, sample ids, token count, sha256; "complete" when done
  plan.json                which samples go in which shard (fixed on the first run)

Before starting it prints the disk space needed and refuses to start without it (keeping
extract.min_free_disk_gb free). Rerunning resumes at shard granularity and verifies the shards
already written (a truncated or corrupted shard is recomputed); --overwrite starts over.
Multi-GPU: `torchrun --nproc_per_node 8 02_extract_hidden.py --config ...` (one model per GPU, shard
k on rank k % 8); a target too big for one GPU: one process, target.device_map=auto shards it.
"""

from common.core.cli import stage_main


def run(cfg, args):
    from common.extract.stage import run_extraction

    run_extraction(cfg, overwrite=args.overwrite)
    return 0


if __name__ == "__main__":
    stage_main("02_extract_hidden", __doc__, run)
