"""The KV connector that hands vLLM's extracted hidden states to stage 02 (CPU and CUDA).

vLLM's speculative method "extract_hidden_states" runs the target with its EAGLE-3 aux outputs
switched on and stores the stacked states [T, n_ids, H] of every prompt token in the KV cache of
one cache-only "attention" layer (model_executor/models/extract_hidden_states.py). A KV connector
decides what happens to them when the request finishes. vLLM 0.32 ships only an example one
(ExampleHiddenStatesConnector) that needs CUDA streams, events and pinned memory; this one is the
project's own, loaded with KVTransferConfig.kv_connector_module_path = "common.extract.vllm_connector":

- scheduler side: every new request gets the file <storage_path>/<request id>.safetensors; when the
  request finishes, its blocks of the hidden-state group are kept (delay_free) and handed to the
  worker in the next step's metadata, and the path goes back to the client in the request output
  (RequestOutput.kv_transfer_params["hidden_states_path"]).
- worker side (TP rank 0 only; every TP rank holds the full replicated states): gather the request's
  T rows from the cache, then write {"hidden_states": [T, n_ids, H]} to a temp name and rename it,
  so the file appears complete or not at all; the client waits for the name. On CPU the gather is
  a plain copy; on CUDA it is an async copy on a side stream into pinned memory, and the blocks are
  released once that copy's event has completed. Disk writes run on a small thread pool.

Files are removed by the client after reading (common/extract/vllm_backend.py), so the directory holds at
most the requests in flight. See docs/design.md, "Hidden-state extraction through vLLM".
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("extract.connector")

PATH_KEY = "hidden_states_path"
TMP_SUFFIX = ".partial"


@dataclass
class PendingSave:
    req_id: str
    path: str
    num_tokens: int
    block_ids: list[int]


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    saves: list[PendingSave] = field(default_factory=list)


def hidden_state_group_id(kv_cache_config: "KVCacheConfig | None") -> int:
    """The KV-cache group that holds the cache-only layer.

    Its spec (HiddenStateCacheSpec) subclasses MLAAttentionSpec, so next to MLA layers of the same
    page size it may share their group; then the only group is the one.
    """
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    holding = [i for i, g in enumerate(groups) if any(".cache_only_layers." in n or n.startswith("cache_only_layers.")
                                                         for n in g.layer_names)]
    if len(holding) == 1:
        return holding[0]
    raise ValueError(f"cannot find the extract-hidden-states KV-cache group among {len(groups)} groups: "
                     f"{[type(g.kv_cache_spec).__name__ for g in groups]}")


class HiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._group_id = hidden_state_group_id(kv_cache_config)
        if kv_cache_config is not None:
            self._block_size = kv_cache_config.kv_cache_groups[self._group_id].kv_cache_spec.block_size
        else:
            self._block_size = vllm_config.cache_config.block_size
        self._storage = self._kv_transfer_config.get_from_extra_config("shared_storage_path", None)
        if not self._storage:
            raise ValueError("HiddenStatesConnector needs kv_connector_extra_config.shared_storage_path")
        # scheduler side
        self._paths: dict[str, str] = {}
        self._finished: list[PendingSave] = []
        # worker side
        self._kv_cache: torch.Tensor | None = None
        self._writes_enabled = True
        self._copy_stream = None
        self._copy_events: dict[str, Any] = {}
        self._finished_req_ids: set[str] = set()
        self._saved: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=int(self._kv_transfer_config.get_from_extra_config("num_writer_threads", 4)),
                                          thread_name_prefix="hidden-states-writer")
        self._writes: set[Future] = set()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._writes_enabled = get_tensor_model_parallel_rank() == 0
        names = [n for n in kv_caches if "cache_only_layers." in n]
        if len(names) != 1:
            raise ValueError(f"expected one cache-only layer for extract_hidden_states, got {names} among {list(kv_caches)[:4]}...")
        cache = kv_caches[names[0]]
        if cache.dim() != 4 or cache.shape[2] != self._block_size:
            raise ValueError(f"hidden-state cache has shape {tuple(cache.shape)}; expected [blocks, n_ids, block_size "
                             f"{self._block_size}, hidden]")
        self._kv_cache = cache

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the cache-only layer already wrote the states; we read them when the request finishes

    def wait_for_save(self) -> None:
        pass

    def _gather(self, save: PendingSave) -> torch.Tensor:
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()[: save.num_tokens]
        cache = self._kv_cache
        if cache.device.type == "cpu":
            return cache[slots // self._block_size, :, slots % self._block_size].clone()
        # CUDA: gather and copy to pinned host memory on a side stream, after what the model wrote.
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=cache.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self._copy_stream):
            slots = slots.to(cache.device, non_blocking=True)
            rows = cache[slots // self._block_size, :, slots % self._block_size]
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self._copy_events[save.req_id] = event
        return host

    @staticmethod
    def _write(tensor: torch.Tensor, path: str, event) -> None:
        from safetensors.torch import save_file

        if event is not None:
            event.synchronize()
        tmp = path + TMP_SUFFIX
        save_file({"hidden_states": tensor}, tmp)
        os.replace(tmp, path)  # the client waits for this name: complete or absent

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, HiddenStatesMetadata) and self._writes_enabled:
                for save in meta.saves:
                    self._saved.add(save.req_id)
                    os.makedirs(os.path.dirname(save.path), exist_ok=True)
                    rows = self._gather(save)
                    future = self._writer.submit(self._write, rows, save.path, self._copy_events.get(save.req_id))
                    self._writes.add(future)
                    future.add_done_callback(self._write_done)
        self._finished_req_ids.update(finished_req_ids)
        done = set()
        for req_id in list(self._finished_req_ids):
            event = self._copy_events.get(req_id)
            if event is not None and not event.query():
                continue  # the copy out of the blocks is still running: keep them
            self._copy_events.pop(req_id, None)
            self._finished_req_ids.discard(req_id)
            if req_id in self._saved:  # only requests whose blocks we kept (aborted ones were freed)
                self._saved.discard(req_id)
                done.add(req_id)
        return done or None, None

    def _write_done(self, future: Future) -> None:
        self._writes.discard(future)
        if future.exception() is not None:
            log.error("writing extracted hidden states failed: %r", future.exception())

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 reports; the others never hold a save

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = HiddenStatesMetadata(saves=self._finished)
        self._finished = []
        for new in scheduler_output.scheduled_new_reqs:
            self._paths[new.req_id] = os.path.join(self._storage, f"{new.req_id}.safetensors")
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        path = self._paths.pop(request.request_id, None)
        if path is None or request.prompt_token_ids is None:
            return False, None  # aborted before it was scheduled
        self._finished.append(PendingSave(request.request_id, path, len(request.prompt_token_ids), list(block_ids)))
        return True, {PATH_KEY: path}

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group_id < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group_id])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return "LBNHC"  # [blocks, n_ids, block_size, H]: a token's states together
