"""Padding-free packing: position ids restart per example, no cross-example labels, same loss."""

from __future__ import annotations

import numpy as np
import torch

from notebookkit.data.packing import PaddingFreeCollator, pack_examples, packing_stats, position_ids_from_lengths


def test_position_ids_restart():
    assert position_ids_from_lengths([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]


def test_collator_flattens_and_masks_boundaries():
    batch = PaddingFreeCollator(return_seq_lens=True)(
        [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert "attention_mask" not in batch
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5] and batch["max_length_q"] == 3


def test_pack_examples_first_fit_decreasing_and_collate_packed_rows():
    ex = [{"input_ids": list(range(n)), "labels": [1] * n} for n in (5, 3, 4, 2, 6)]
    rows = pack_examples(ex, max_length=8)
    assert all(len(r["input_ids"]) <= 8 for r in rows)
    assert sorted(n for r in rows for n in r["seq_lengths"]) == [2, 3, 4, 5, 6]
    assert len(rows) == 3  # 20 tokens in rows of 8
    batch = PaddingFreeCollator()(rows)
    pos = batch["position_ids"][0]
    assert int((pos == 0).sum()) == 5
    assert int((batch["labels"] != -100).sum()) == 20 - 5
    assert pack_examples([{"input_ids": list(range(10))}], 4)[0]["seq_lengths"] == [4]


def test_packed_loss_equals_padded_loss():
    """With isolation (here: per-example causal attention), packing leaves the loss unchanged."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16)

    def logits_for(ids, pos):
        # position-aware toy model: each token sees only its own sequence prefix (cumulative mean)
        x = emb(ids) + 0.1 * pos[..., None].float()
        out = torch.empty_like(x)
        starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:]):
            out[a:b] = x[a:b].cumsum(0) / torch.arange(1, b - a + 1)[:, None]
        return head(out)

    examples = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}]
    packed = PaddingFreeCollator()(examples)
    lg = logits_for(packed["input_ids"][0], packed["position_ids"][0])
    loss_packed = torch.nn.functional.cross_entropy(lg[:-1], packed["labels"][0][1:], ignore_index=-100)
    per_tok = []
    for ex in examples:
        ids = torch.tensor(ex["input_ids"])
        lg1 = logits_for(ids, torch.arange(len(ids)))
        per_tok.append(torch.nn.functional.cross_entropy(lg1[:-1], ids[1:], reduction="none"))
    loss_sep = torch.cat(per_tok).mean()
    torch.testing.assert_close(loss_packed, loss_sep)


def test_packing_stats():
    stats = packing_stats([10, 100, 10, 100], max_length=128, batch_size=4)
    assert stats.real_tokens == 220 and stats.padded_slots == 400
    assert stats.packed_rows == 2 and np.isclose(stats.padding_waste, 0.45)
    assert "padding" in str(stats)
