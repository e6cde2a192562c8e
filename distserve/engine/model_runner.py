"""Runs a Hugging Face causal LM for serving: batched prefill and paged decode steps.

The model's own forward (any Llama/Qwen2/Mistral-family module) does the maths;
the runner only shapes batches and moves KV between the model's cache object and
our storage. Decode gathers each sequence's blocks into a left-padded batch,
which keeps correctness on the model's code path for every architecture; a fused
paged-attention kernel can replace the gather later without changing callers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from distserve.engine.kv_cache import PagedKvCache


def _layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    entry = cache.layers[layer]
    return entry.keys, entry.values


class ModelRunner:
    """Owns the model; every method runs under inference mode and is thread-agnostic."""

    def __init__(self, model, device: str):
        self.model = model
        self.device = torch.device(device)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Runs prompts as one right-padded batch.

        Right padding keeps every real token's attention exact under the causal
        mask alone (padding only ever comes after real tokens).
        Returns last-token logits [B, V] (float32) and, per prompt, its KV on the
        CPU as one contiguous tensor [L, 2, H, T_i, D].
        """
        max_len = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), max_len), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        cache = DynamicCache()
        out = self.model(input_ids=ids.to(self.device), cache=cache, use_cache=True)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        logits = out.logits[torch.arange(len(prompts), device=self.device), last].float()
        num_layers = len(cache.layers)
        # stacked: [L, 2, B, H, T, D]
        stacked = torch.stack(
            [torch.stack(_layer_kv(cache, i)) for i in range(num_layers)]
        )
        kvs = [stacked[:, :, b, :, : len(p)].to("cpu").contiguous() for b, p in enumerate(prompts)]
        return logits.cpu(), kvs

    @torch.inference_mode()
    def decode(
        self,
        kv_cache: PagedKvCache,
        tables: list[list[int]],
        context_lens: list[int],
        input_ids: list[int],
    ) -> torch.Tensor:
        """One decode step for a batch: feeds input_ids[b] at position context_lens[b].

        Reads the past from the paged cache, writes the new token's KV back into
        it, and returns next-token logits [B, V] (float32, CPU).
        """
        batch = len(tables)
        max_len = max(context_lens)
        past = kv_cache.gather(tables, context_lens)  # [L, 2, B, H, max_len, D]
        cache = DynamicCache()
        for layer in range(past.shape[0]):
            cache.update(past[layer, 0], past[layer, 1], layer)
        # mask: [B, max_len + 1]; left padding is 0, real past and the new token 1.
        mask = torch.zeros((batch, max_len + 1), dtype=torch.long, device=self.device)
        for b, n in enumerate(context_lens):
            mask[b, max_len - n :] = 1
        out = self.model(
            input_ids=torch.tensor(input_ids, device=self.device).unsqueeze(1),
            attention_mask=mask,
            position_ids=torch.tensor(context_lens, device=self.device).unsqueeze(1),
            cache=cache,
            use_cache=True,
        )
        new_kv = torch.stack(
            [torch.stack([k[:, :, -1], v[:, :, -1]]) for k, v in (_layer_kv(cache, i) for i in range(past.shape[0]))]
        )  # [L, 2, B, H, D]
        kv_cache.write_tokens(tables, context_lens, new_kv)
        return out.logits[:, -1].float().cpu()
