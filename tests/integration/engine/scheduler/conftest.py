"""SmolLM2 for the scheduler tests: the session's shared float32 runner
(tests/conftest.py ``smollm2_runner``) seen through a private slot allocator,
plus the model's tokenizer (loaded once per session)."""

import pytest
import torch

from fleetserve.engine.args import ServerArgs
from fleetserve.core.kv_pool import TokenSlotAllocator
from fleetserve.models.tokenizer import load_tokenizer
from fleetserve.engine.scheduler import Scheduler


@pytest.fixture(scope="session")
def smol(smollm2_runner):
    """(model runner, tokenizer) for SmolLM2-135M-Instruct in float32."""
    torch.set_num_threads(2)
    tok = load_tokenizer(smollm2_runner.model_path)
    return smollm2_runner, tok


class RunnerView:
    """The shared runner with a private slot allocator (a fresh, possibly smaller, pool).

    The shared runner's own allocator is never touched, so its other users see
    no change; KV rows are rewritten before they are read.
    """

    def __init__(self, runner, pool_size, page_size=1):
        self._runner = runner
        # the runner's KV rows end at max_total_tokens; a paged pool's last page must fit too
        self.allocator = TokenSlotAllocator(min(pool_size, runner.max_total_tokens - page_size + 1), page_size)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def make_scheduler(runner, pool_size=2048, **kw):
    kw.setdefault("random_seed", 0)
    return Scheduler(ServerArgs(**kw), RunnerView(runner, pool_size, kw.get("page_size", 1)), check_invariants=True)


@pytest.fixture
def smol_sched(smol):
    """Factory: a fresh scheduler on SmolLM2 (``pool_size`` and ServerArgs fields as keywords)."""
    runner, _ = smol
    return lambda **kw: make_scheduler(runner, **kw)


@pytest.fixture
def smol_view(smol):
    """SmolLM2's runner with a fresh full-size allocator."""
    return RunnerView(smol[0], smol[0].max_total_tokens)


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run tiny batches where one thread is faster than two (no
    OpenMP barriers; on a busy machine two threads can be 5x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
