"""Write the embedded sample dataset, data/sample_prompts.jsonl.

The rows come from the same deterministic generator as the tiny target's training corpus
(common/tiny_target.py), so the prompts the embedded pipeline sends are in the target's
distribution. The file mixes the two shapes stage 01 reads (ShareGPT `conversations` and
OpenAI `messages`), with some multi-turn rows and some system prompts.

    python scripts/make_sample_data.py [--n 400] [--seed 0] [--out data/sample_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.io import write_jsonl_atomic  # noqa: E402
from common.tiny_target import sample_prompt_rows  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=400, help="number of rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "data" / "sample_prompts.jsonl"))
    args = parser.parse_args()
    n = write_jsonl_atomic(args.out, sample_prompt_rows(args.n, args.seed))
    size_kb = Path(args.out).stat().st_size / 1024
    print(f"wrote {n} rows ({size_kb:.0f} KB) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
