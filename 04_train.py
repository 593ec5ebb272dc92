"""Stage 04: train the EAGLE-3 draft head (training-time test) on the extracted hidden states.

Reads hidden/ (02), vocab/vocab_map.safetensors (03) and the target's embedding + lm_head.
Writes under run_dir/train/: checkpoints/step-N/ (full state, every train.checkpoint_every
steps, last train.keep_checkpoints kept), metrics.jsonl, tb/ (TensorBoard), eval_report.json
(per-step accuracy, expected acceptance length) and final/ (the vLLM-loadable draft).

  python 04_train.py --config configs/run.yaml                        # CPU or one GPU
  torchrun --nproc_per_node 8 04_train.py --config configs/run.yaml     # DDP (train.parallel=fsdp: FSDP2)
  torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
      --rdzv_id eagle3 04_train.py --config configs/run.yaml            # several nodes, shared run_dir

Rerunning resumes from the latest checkpoint; --overwrite starts over; a finished run exits 0.
"""

from common.core.cli import stage_main


def run(cfg, args):
    from common.train.trainer import run_training

    return run_training(cfg, overwrite=args.overwrite)


if __name__ == "__main__":
    stage_main("04_train", __doc__, run)
