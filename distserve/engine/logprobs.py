"""Log-probabilities of chosen and prompt tokens, with the most likely alternatives.

Values are the model's raw distribution: log_softmax of the logits as the model produced them,
before penalties, grammar masks, temperature, top-k/top-p and min_p (vLLM's default
`logprobs_mode=raw_logprobs`). So a token's logprob is what the model thought of it, whatever
the sampler then did; a greedy token has rank 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distserve.request_types import TokenLogprobs


def rows_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """logits [N, V] (any float dtype), token_ids [N] -> one TokenLogprobs per row, for token_ids[row]."""
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = torch.as_tensor(list(token_ids), dtype=torch.long)
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [N, 1]
    ranks = (logprobs > chosen_lp).sum(-1) + 1  # [N]
    top_lp, top_ids = (logprobs.topk(num_top, dim=-1) if num_top > 0 else
                       (logprobs[:, :0], torch.zeros((logprobs.shape[0], 0), dtype=torch.long)))
    chosen_list, ranks_list = chosen_lp[:, 0].tolist(), ranks.tolist()
    top_ids_list, top_lp_list = top_ids.tolist(), top_lp.tolist()
    return [TokenLogprobs(int(token_ids[i]), chosen_list[i], ranks_list[i], tuple(top_ids_list[i]),
                          tuple(top_lp_list[i])) for i in range(len(chosen_list))]


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """logits [V] -> the TokenLogprobs of token_id with num_top alternatives."""
    return rows_logprobs(logits[None], [token_id], num_top)[0]
