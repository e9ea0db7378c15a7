"""Each distinct prompt of a micro-batch computed once (``actor.share_prompts``).

GRPO and its relatives sample n responses to every prompt, so a padded micro-batch runs each prompt
through the model n times. Here the rows of one prompt become one packed sequence instead: the
prompt, then every response after it, each response at the positions it would have right after the
prompt. A 4-D attention mask lets each token see the prompt and the earlier tokens of its own
response only, so every response token's logits are those of its own unpacked row, to float rounding
(the kernels sum in another order), and the prompt's gradient is the sum of its responses', as it
would be by rows. The logits of each response token come from its packed column: the first token's
from the prompt's last column, which every response of the prompt shares.

Packed rows are laid out like a ``TrainBatch`` row: prompts left-padded so that they all end at the
same column, responses after it, right-padded, so one ``logits_to_keep`` covers every response.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offstep.batch import TrainBatch, prompt_groups

PAD_SEGMENT, PROMPT_SEGMENT = -1, 0  # a packed column's segment: padding, the prompt, or response i + 1


@dataclass
class SharedLayout:
    input_ids: torch.Tensor  # [G, L]: one packed row per distinct prompt
    position_ids: torch.Tensor  # [G, L]
    attention_mask: torch.Tensor  # [G, 1, L, L] bool, True: the query (row) may attend to the key (column)
    keep: int  # logits_to_keep: the last ``keep`` columns, from the prompts' last one
    row: torch.Tensor  # [B]: each sample's packed row
    index: torch.Tensor  # [B, R]: the kept column whose logits predict each response token

    def logits(self, kept: torch.Tensor) -> torch.Tensor:
        """[B, R, V] response-token logits from the packed rows' kept logits [G, keep, V]."""
        return kept[self.row[:, None], self.index]


def shared_layout(mb: TrainBatch, groups: list[list[int]] | None = None) -> SharedLayout:
    """The packed form of ``mb``: one row per group (``groups``: rows sharing a prompt, all rows
    in some group once; default ``prompt_groups``; ``offstep.batch.prompt_units`` cuts long ones)."""
    groups = prompt_groups(mb) if groups is None else groups
    P, R = mb.prompt_len, mb.response_mask.shape[1]
    device = mb.input_ids.device
    prompt_lens = mb.attention_mask[:, :P].sum(-1).tolist()
    response_lens = mb.attention_mask[:, P:].sum(-1).tolist()
    p_max = max(int(prompt_lens[g[0]]) for g in groups)
    width = max(1, max(sum(int(response_lens[b]) for b in g) for g in groups))
    G, L = len(groups), p_max + width
    input_ids = torch.zeros((G, L), dtype=torch.long, device=device)
    position_ids = torch.zeros((G, L), dtype=torch.long, device=device)
    segment = torch.full((G, L), PAD_SEGMENT, dtype=torch.long, device=device)
    row = torch.zeros(len(mb), dtype=torch.long, device=device)
    index = torch.zeros((len(mb), R), dtype=torch.long, device=device)
    for g, rows in enumerate(groups):
        p = int(prompt_lens[rows[0]])
        input_ids[g, p_max - p : p_max] = mb.input_ids[rows[0], P - p : P]
        position_ids[g, p_max - p : p_max] = torch.arange(p, device=device)
        segment[g, p_max - p : p_max] = PROMPT_SEGMENT
        start = p_max
        for i, b in enumerate(rows):
            r = int(response_lens[b])
            input_ids[g, start : start + r] = mb.input_ids[b, P : P + r]
            position_ids[g, start : start + r] = torch.arange(p, p + r, device=device)
            segment[g, start : start + r] = i + 1
            row[b] = g
            # kept column c holds the logits of packed column p_max - 1 + c: token t of this
            # response is predicted by the prompt's last column (t = 0) or by its own token t - 1.
            if r > 1:
                index[b, 1:r] = torch.arange(start - p_max + 1, start - p_max + r, device=device)
            start += r
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones((L, L), dtype=torch.bool, device=device).tril()
    allowed = ((key == PROMPT_SEGMENT) & (query != PAD_SEGMENT)) | (key == query)
    mask = (allowed & causal)[:, None]
    return SharedLayout(input_ids, position_ids, mask, width + 1, row, index)
