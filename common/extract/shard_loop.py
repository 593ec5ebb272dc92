"""Stage 02's shard loop: the backend that runs the target (open_extractor), and this process's shards through it,
each written by a background thread and recorded in the index (extract_shards).

Batching and memory
- Samples of one shard are sorted by length (longest first, ties by input order) and packed into
  right-padded batches with rows * max_len <= extract.batch_max_tokens (a single longer sample gets a
  batch of its own); the attention mask hides the padding. A batch's results go to CPU immediately;
  a shard is written when complete, so host memory is bounded by one shard being filled plus one being
  written (by a background thread, overlapping disk I/O and hashing with the next forward passes).
  Peak host RAM ~ 2 * shard_max_tokens * bytes_per_token: pick shard_max_tokens accordingly
  (Kimi-K2.5 bf16: 57,353 B/token, so 65,536 tokens per shard = 3.8 GB per shard).
- Shards are written to a temp name and renamed (common.hidden.shards.write_shard); the index is rewritten
  atomically after every shard with the shard's sha256 (computed while writing). Under torchrun each rank
  writes an index fragment (Layout.index_fragment, atomic) and rank 0 merges the fragments into index.json
  after each of its shards (common.hidden.index.record_entries: the merge is a pure function of the fragments,
  so it is idempotent).

Backends (extract.backend; docs/design.md#hidden-state-extraction-through-vllm)
- hf: the target in transformers (common/extract/hf_backend.py). The reference, and for targets vLLM cannot
  run; it refuses a target whose materialised weights (quantized ones decompressed, e.g. Kimi-K2.5's int4
  experts to bf16) exceed the memory it would use, naming the vllm backend. Placement: extract.device (auto =
  cuda if available, else cpu); target.device_map "auto" puts the model on one GPU if its weights fit in 90% of
  that GPU's memory, else shards it over all visible GPUs with transformers device_map="auto" (layers on
  different GPUs, run one after the other: it works for any size that fits the node, at 1/num_gpus
  utilisation). Any other value ("balanced", "sequential") is passed to transformers as is.
- vllm (auto = vllm where installed): the target runs in vLLM with its "extract_hidden_states" method and our
  KV connector (common/extract/vllm_backend.py, common/extract/vllm_connector.py), with TP/DP/EP from
  extract.*; same plan, shards, index and resume, one request per sample.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from common.core import dtype_choice
from common.core.io import format_bytes
from common.core.run_folder import Layout, remember_fingerprint
from common.extract.scan import read_shard_samples
from common.hidden.index import record_entries, shard_entry
from common.hidden.rounds import HiddenPlan
from common.hidden.shards import write_shard

if TYPE_CHECKING:  # torch is imported only when the stage runs
    from common.core.distributed import DistEnv

log = logging.getLogger("extract")


@dataclass
class ExtractStats:
    """What extract_shards did in this process (added up over the rounds of a streaming run)."""

    tokens: int = 0
    bytes: int = 0  # written
    seconds: float = 0.0
    shards: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def __add__(self, other: "ExtractStats") -> "ExtractStats":
        return ExtractStats(self.tokens + other.tokens, self.bytes + other.bytes, self.seconds + other.seconds,
                            self.shards + other.shards)


def open_extractor(cfg, info, layout: Layout, env: DistEnv, out_dtype):
    """The backend that runs the target: HfExtractor, or VllmExtractor (common/extract/vllm_backend.py)."""
    from common.extract.hf_backend import HfExtractor
    from common.extract.vllm_backend import VllmExtractor, resolve_backend

    backend = resolve_backend(cfg)
    if env.is_main:
        print(f"02_extract_hidden: extract.backend {backend}" + (f" (TP {cfg.extract.tensor_parallel_size}, DP {env.world_size}, "
              f"expert parallel {cfg.extract.enable_expert_parallel})" if backend == "vllm" else ""), flush=True)
        dtype_choice.announce()  # target.dtype / extract.dtype: what auto chose here, and why
    if backend == "hf":
        return HfExtractor(cfg, info, env, out_dtype)
    return VllmExtractor(cfg, info, out_dtype, layout.vllm_requests(env.rank), dp_rank=env.rank, dp_size=env.world_size)


def extract_shards(cfg, layout: Layout, plan: HiddenPlan, header: dict, mine: list[str], done: dict[str, dict],
                   env: DistEnv, extractor, busiest: int = 0) -> ExtractStats:
    """Extract this process's shards (`mine`, plan files) with `extractor` (open_extractor); done: the index
    entries kept so far. busiest: how many shards the busiest rank has (vLLM data-parallel engines step
    together, so a rank with fewer joins the remaining steps with a dummy request)."""
    placement = getattr(extractor, "placement", "vllm")
    paths = {split: layout.split_jsonl(split) for split in plan.doc["inputs"]}
    entries = dict(done)  # this process's view; rank 0 also sees the others' fragments when merging
    my_entries: dict[str, dict] = {}
    stats = ExtractStats(shards=len(mine))
    total = sum(plan.by_file[f]["num_tokens"] for f in mine)
    bar = tqdm(total=total, unit="tok", unit_scale=True, dynamic_ncols=True, file=sys.stderr,
               desc="extract" if not env.distributed else f"extract[rank {env.rank}]")
    log.info("target on %s; %d shards for this process", placement, len(mine))

    def finish(name: str, samples: list[dict], batches: list[dict]) -> None:
        # Runs in the writer thread: write the shard, then record it (index only after the rename).
        entry = shard_entry(plan.by_file[name], write_shard(layout.hidden / name, samples, batches, header["storage"]))
        remember_fingerprint(layout, layout.hidden / name, entry["sha256"])  # 04 checks it without reading it again
        my_entries[name] = entry
        entries[name] = entry
        record_entries(layout, env, header, plan.shards, my_entries, entries)
        stats.bytes += entry["bytes"]
        bar.set_postfix_str(f"{format_bytes(stats.bytes)} written", refresh=False)

    def tick(n: int) -> None:
        bar.update(n)
        stats.tokens += n

    start = time.perf_counter()
    pending = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hidden-writer") as writer:
        try:
            for name in mine:
                shard = plan.by_file[name]
                samples = read_shard_samples(paths[shard["split"]], shard)
                batches = extractor.extract(samples, tick)
                if pending is not None:
                    pending.result()  # at most one shard waiting to be written: bounded memory
                pending = writer.submit(finish, name, samples, batches)
            for _ in range(busiest - len(mine)):
                extractor.idle_round()
            if pending is not None:
                pending.result()
        finally:
            bar.close()
    stats.seconds = time.perf_counter() - start
    return stats
