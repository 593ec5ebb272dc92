"""05's replay over the served outputs: vLLM's greedy rounds replayed (common/model/acceptance.py)
over the exact token ids vLLM generated, with the target run in transformers."""

from __future__ import annotations

from common.model.acceptance import ReplayCounts, replay_sample
from common.model.export import load_exported_draft
from common.model.ttt import ttt_loss
from common.target.hf_forward import HiddenStateCapture, choose_device, find_decoder_stack, forward_batch, load_target_model
from common.target.loading import load_target_info, load_target_tensors


def replay_on_token_ids(cfg, draft_dir, sequences: list[tuple[list[int], list[int]]], k: int) -> dict:
    """The replay over given (prompt ids, generated ids) sequences, e.g. what vLLM served.

    Runs the target in transformers (02's hooks: aux states and final-norm output), the exported
    draft's TTT steps with per-position correctness, and `replay_sample` over the generated part.
    On greedy outputs the target's top-1 is the next token, so this reproduces vLLM's rounds up to
    numerics (the draft runs from its exported weights, as vLLM does).
    """
    import torch

    info = load_target_info(cfg.target)
    device = choose_device(cfg.extract.device)
    model, _ = load_target_model(cfg.target, device)
    stack = find_decoder_stack(model, info.num_layers)
    capture = HiddenStateCapture(stack, info.aux_layer_ids, torch.float32)
    target = load_target_tensors(cfg.target.model)
    draft = load_exported_draft(draft_dir, embedding=target["embed"].float(), device=device)
    lm_head = target["lm_head"].float().to(device)
    counts = ReplayCounts(k)
    try:
        with torch.no_grad():
            for prompt_ids, generated_ids in sequences:
                ids = list(prompt_ids) + list(generated_ids)
                states = forward_batch(stack, capture, [{"input_ids": ids}])
                generated = [0] * len(prompt_ids) + [1] * len(generated_ids)
                out = ttt_loss(draft, states["aux"].to(device), torch.tensor(ids, device=device), states["final"].to(device),
                               torch.tensor(generated, device=device), torch.arange(len(ids), device=device), [len(ids)],
                               lm_head, k, 1.0, per_position=True)
                counts.add(replay_sample(out.step_hits.cpu().numpy(), generated, k))
    finally:
        capture.remove()
    return counts.to_dict() | {"num_sequences": len(sequences)}
