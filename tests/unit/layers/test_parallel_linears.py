"""TP sharding of the linears without a process group: every rank's shard,
combined by hand the way the collectives would, equals the unsharded layer."""

import torch

from fleetserve.layers.linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TPGroup,
                                      VocabParallelEmbedding)
from helpers.weight_source import DictSource


def test_column_row_vocab_shards_recombine():
    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g), torch.randn(6, 8, generator=g)
    emb = torch.randn(11, 6, generator=g)
    src = DictSource(gate=gate, up=up, down=down, emb=emb)
    x = torch.randn(5, 6, generator=g)
    ids = torch.tensor([0, 3, 5, 6, 10])
    col_parts, row_sum, head_parts = [], 0, []
    for rank in range(2):
        tp = TPGroup(rank, 2)
        col = ColumnParallelLinear(6, [8, 8], tp=tp)
        col.load(src, "gate", 0)
        col.load(src, "up", 1)
        y = col(x)
        col_parts.append(y)
        row = RowParallelLinear(8, 6, tp=tp, reduce_results=False)
        row.load(src, "down")
        row_sum = row_sum + row(torch.nn.functional.silu(y[:, :4]) * y[:, 4:])
        e = VocabParallelEmbedding(11, 6, tp=tp)
        e.load(src, "emb")
        assert e.weight.shape == (6, 6)  # 11 padded to 12 rows, 6 per rank
        head = ParallelLMHead(11, 6, tp=tp, tied_to=e)
        head_parts.append(torch.nn.functional.linear(x, head.weight))
    full_gate, full_up = x @ gate.T, x @ up.T
    torch.testing.assert_close(torch.cat([col_parts[0][:, :4], col_parts[1][:, :4]], -1), full_gate)
    torch.testing.assert_close(torch.cat([col_parts[0][:, 4:], col_parts[1][:, 4:]], -1), full_up)
    torch.testing.assert_close(row_sum, (torch.nn.functional.silu(full_gate) * full_up) @ down.T)
    torch.testing.assert_close(torch.cat(head_parts, -1)[:, :11], x @ emb.T)
    single = VocabParallelEmbedding(11, 6)
    single.load(src, "emb")
    torch.testing.assert_close(single(ids), emb[ids])
