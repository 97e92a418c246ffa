"""A fake model runner whose next token depends on the KV it reads back.

Each forward writes every new token's id and position into a fake KV pool at
``out_cache_loc``; the logits of a token are a fixed random row chosen by a
hash of the whole history gathered through ``kv_indices``. A slot handed to
two requests, a wrong prefix from the radix cache or a lost chunk changes the
history, hence the tokens; a position mismatch fails loudly.
"""

import torch

from fleetserve.engine.args import ServerArgs
from fleetserve.core.forward_batch import ForwardBatch, ForwardMode
from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.engine.scheduler import Scheduler

torch.set_num_threads(1)


class FakeRunner:
    M = 257  # number of distinct logit rows

    def __init__(self, pool_size=512, vocab_size=50, max_context_len=1024, eos_token_ids=(), seed=0, page_size=1):
        self.allocator = TokenSlotAllocator(pool_size, page_size)
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.eos_token_ids = list(eos_token_ids)
        self.device = "cpu"
        rows = self.allocator.max_slot + 1  # paged: the last page ends past pool_size
        self.tok = torch.full((rows,), -1, dtype=torch.int64)
        self.pos = torch.full((rows,), -1, dtype=torch.int64)
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(self.M, vocab_size, generator=g) * 3.0
        self.forwards = []  # (mode, batch size, num tokens) per call

    def _row(self, hist: list[int]) -> torch.Tensor:
        h = 0
        for k, t in enumerate(hist):
            h = (h * 31 + (t + 1) * (k + 7)) % 1_000_003
        return self.table[h % self.M]

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.forwards.append((fb.mode, fb.batch_size, fb.num_tokens))
        if fb.mode == ForwardMode.IDLE:
            return torch.zeros(0, self.vocab_size)
        assert fb.out_cache_loc.numel() == fb.input_ids.numel()
        assert bool((fb.out_cache_loc >= 1).all()), "slot 0 is scratch"
        self.tok[fb.out_cache_loc] = fb.input_ids
        self.pos[fb.out_cache_loc] = fb.positions
        rows = []
        for i in range(fb.batch_size):
            idx = fb.kv_indices[i]
            assert idx.numel() == int(fb.seq_lens[i])
            assert self.pos[idx].tolist() == list(range(idx.numel())), "KV slots hold wrong positions"
            hist = self.tok[idx].tolist()
            e = int(fb.extend_seq_lens[i])
            if fb.return_all_logits:
                for j in range(len(hist) - e, len(hist)):
                    rows.append(self._row(hist[: j + 1]))
            else:
                rows.append(self._row(hist))
        return torch.stack(rows).float()


def make_scheduler(pool_size=512, vocab_size=50, eos=(), **kw):
    runner = FakeRunner(pool_size=pool_size, vocab_size=vocab_size, eos_token_ids=eos,
                        page_size=kw.get("page_size", 1))
    kw.setdefault("random_seed", 0)
    args = ServerArgs(**kw)
    return Scheduler(args, runner, check_invariants=True)
