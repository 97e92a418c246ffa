"""Start ``torch.distributed`` for one rank and build its process groups.

Three steps, kept apart so each can be tested alone:

* :class:`ParallelConfig` + :func:`validate` refuse impossible size
  combinations (and, given a model's shape, impossible model/size pairs) with
  a message that names the flags involved.
* :func:`rank_layout` is pure arithmetic: which attention group, expert range
  and groups a rank belongs to (see ARCHITECTURE.md for the meaning of sizes).
* :func:`init_distributed` calls ``init_process_group`` (with a timeout) and
  :func:`build_parallel_state` creates the groups and returns the
  :class:`~fleetserve.distributed.parallel_state.ParallelState` the models use.

Rank arithmetic (``T = tp_size``, ``D = attn_dp_size``, ``E = ep_size``)::

    attn_tp_size = T // D        attn_dp_rank = r // attn_tp_size   attn_tp_rank = r % attn_tp_size
    moe_tp_size  = T // E        ep_rank      = r // moe_tp_size    moe_tp_rank  = r % moe_tp_size

Attention groups and expert-TP groups are runs of consecutive ranks; the
attention-DP group (ranks with the same ``attn_tp_rank``) and the EP group
(ranks with the same ``moe_tp_rank``) are strided. This is SGLang's layout.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fleetserve.distributed.parallel_state import ParallelState

logger = logging.getLogger(__name__)

# Token dispatch for expert parallelism (--moe-a2a-backend): see moe_dispatch.py.
MOE_A2A_BACKENDS = ("allgather", "all_to_all")


class ParallelConfigError(ValueError):
    """An impossible combination of parallel sizes (or sizes and model)."""


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel sizes of one engine instance.

    Attributes:
        tp_size: ranks in the instance (SGLang's meaning: the MoE / dense FFN span all of them).
        dp_size: with DP attention, attention groups inside the instance; without,
            independent replicas of the instance (each ``tp_size`` ranks).
        enable_dp_attention: split the ``tp_size`` ranks into ``dp_size`` attention groups.
        ep_size: ranks the routed experts are split over.
        moe_a2a_backend: ``allgather`` or ``all_to_all`` token dispatch for EP.
        nnodes: machines the ranks are spread over.
    """

    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    ep_size: int = 1
    moe_a2a_backend: str = "allgather"
    nnodes: int = 1

    @classmethod
    def from_server_args(cls, args: Any) -> "ParallelConfig":
        """Take the sizes from a ``ServerArgs`` (or any object with the same attribute names)."""
        return cls(
            tp_size=int(args.tp_size),
            dp_size=int(args.dp_size),
            enable_dp_attention=bool(args.enable_dp_attention),
            ep_size=int(args.ep_size),
            moe_a2a_backend=str(args.moe_a2a_backend),
            nnodes=int(getattr(args, "nnodes", 1)),
        )

    @property
    def attn_dp_size(self) -> int:
        """Attention groups per instance (1 without DP attention)."""
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def attn_tp_size(self) -> int:
        """Ranks per attention group (heads are split over them)."""
        return self.tp_size // self.attn_dp_size

    @property
    def moe_tp_size(self) -> int:
        """Ranks each expert's intermediate dimension is split over."""
        return self.tp_size // self.ep_size

    @property
    def num_replicas(self) -> int:
        """Independent instance replicas behind the DP controller (``dp_size`` without DP attention)."""
        return 1 if self.enable_dp_attention else self.dp_size

    @property
    def world_size(self) -> int:
        """Processes in all: ``tp_size`` per replica times the replicas."""
        return self.tp_size * self.num_replicas


@dataclass(frozen=True)
class ModelShape:
    """What :func:`validate` needs to know about a model.

    Attributes:
        architecture: e.g. ``DeepseekV3ForCausalLM``.
        num_attention_heads / num_key_value_heads: query and KV heads (MLA: KV heads unused).
        is_mla: the model caches a compressed latent (DeepSeek-V2/V3).
        n_routed_experts: routed experts per MoE layer (0: dense model).
        moe_intermediate_size: each routed expert's intermediate width.
        intermediate_size: dense FFN width.
    """

    architecture: str
    num_attention_heads: int
    num_key_value_heads: int
    is_mla: bool
    n_routed_experts: int = 0
    moe_intermediate_size: int = 0
    intermediate_size: int = 0

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelShape":
        """Read a transformers ``PretrainedConfig`` (Llama, DeepSeek-V2/V3)."""
        archs = getattr(config, "architectures", None) or [type(config).__name__]
        heads = int(config.num_attention_heads)
        return cls(
            architecture=str(archs[0]),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            is_mla=getattr(config, "kv_lora_rank", None) is not None,
            n_routed_experts=int(getattr(config, "n_routed_experts", None) or 0),
            moe_intermediate_size=int(getattr(config, "moe_intermediate_size", None) or 0),
            intermediate_size=int(getattr(config, "intermediate_size", None) or 0),
        )


def validate(cfg: ParallelConfig, model: ModelShape | None = None) -> None:
    """Refuse impossible combinations at start-up.

    Raises:
        ParallelConfigError: naming the flags (and model fields) that disagree.
    """
    for name in ("tp_size", "dp_size", "ep_size", "nnodes"):
        if int(getattr(cfg, name)) < 1:
            raise ParallelConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.moe_a2a_backend not in MOE_A2A_BACKENDS:
        raise ParallelConfigError(
            f"--moe-a2a-backend must be one of {MOE_A2A_BACKENDS}, got {cfg.moe_a2a_backend!r}")
    if cfg.enable_dp_attention and cfg.tp_size % cfg.dp_size != 0:
        raise ParallelConfigError(
            f"--enable-dp-attention splits the --tp-size {cfg.tp_size} ranks into --dp-size {cfg.dp_size} "
            f"attention groups, so --tp-size must be divisible by --dp-size")
    if cfg.tp_size % cfg.ep_size != 0:
        raise ParallelConfigError(
            f"--ep-size {cfg.ep_size} must divide --tp-size {cfg.tp_size} "
            f"(the experts are split over ep-size of the instance's tp-size ranks)")
    if cfg.moe_a2a_backend == "all_to_all":
        if cfg.ep_size == 1:
            raise ParallelConfigError("--moe-a2a-backend all_to_all needs --ep-size > 1 (it dispatches tokens "
                                      "between expert-parallel ranks)")
        if cfg.ep_size != cfg.tp_size:
            raise ParallelConfigError(
                f"--moe-a2a-backend all_to_all needs --ep-size equal to --tp-size (got ep {cfg.ep_size}, "
                f"tp {cfg.tp_size}): splitting one expert over several ranks is only supported by allgather")
    if cfg.world_size % cfg.nnodes != 0:
        raise ParallelConfigError(
            f"{cfg.world_size} ranks (tp-size x replicas) cannot be split evenly over --nnodes {cfg.nnodes}")
    if model is None:
        return

    if model.num_attention_heads % cfg.attn_tp_size != 0:
        raise ParallelConfigError(
            f"{model.architecture} has {model.num_attention_heads} attention heads, not divisible by the "
            f"attention TP size {cfg.attn_tp_size} (--tp-size {cfg.tp_size} / attention groups {cfg.attn_dp_size})")
    if not model.is_mla and model.num_key_value_heads % cfg.attn_tp_size != 0:
        raise ParallelConfigError(
            f"{model.architecture} has {model.num_key_value_heads} KV heads, not divisible by the attention "
            f"TP size {cfg.attn_tp_size}")
    if cfg.enable_dp_attention and cfg.attn_dp_size > 1 and not model.is_mla:
        raise ParallelConfigError(
            f"--enable-dp-attention is supported for MLA models (DeepSeek-V2/V3) only; {model.architecture} "
            f"splits its KV heads under plain --tp-size instead")
    if cfg.ep_size > 1 and model.n_routed_experts == 0:
        raise ParallelConfigError(f"--ep-size {cfg.ep_size} needs a MoE model; {model.architecture} has no routed experts")
    if cfg.moe_a2a_backend == "all_to_all" and model.n_routed_experts == 0:
        raise ParallelConfigError(f"--moe-a2a-backend all_to_all needs a MoE model; {model.architecture} has none")
    if model.n_routed_experts and model.n_routed_experts % cfg.ep_size != 0:
        raise ParallelConfigError(
            f"{model.architecture} has {model.n_routed_experts} routed experts, not divisible by --ep-size {cfg.ep_size}")
    if model.n_routed_experts and model.moe_intermediate_size % cfg.moe_tp_size != 0:
        raise ParallelConfigError(
            f"expert intermediate size {model.moe_intermediate_size} is not divisible by the expert TP size "
            f"{cfg.moe_tp_size} (--tp-size {cfg.tp_size} / --ep-size {cfg.ep_size})")
    if model.intermediate_size and model.intermediate_size % cfg.tp_size != 0:
        raise ParallelConfigError(
            f"dense FFN intermediate size {model.intermediate_size} is not divisible by --tp-size {cfg.tp_size}")


@dataclass(frozen=True)
class RankLayout:
    """Position of one rank and the members of each of its groups (instance-local ranks)."""

    tp_rank: int
    attn_tp_rank: int
    attn_dp_rank: int
    ep_rank: int
    moe_tp_rank: int
    attn_tp_ranks: tuple[int, ...]
    attn_dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    moe_tp_ranks: tuple[int, ...]


def group_lists(cfg: ParallelConfig) -> dict[str, list[list[int]]]:
    """Every group of each family, in creation order (all ranks must create them alike)."""
    t, a, m = cfg.tp_size, cfg.attn_tp_size, cfg.moe_tp_size
    return {
        "attn_tp": [list(range(d * a, (d + 1) * a)) for d in range(t // a)],
        "attn_dp": [list(range(j, t, a)) for j in range(a)],
        "moe_tp": [list(range(e * m, (e + 1) * m)) for e in range(t // m)],
        "ep": [list(range(j, t, m)) for j in range(m)],
    }


def rank_layout(cfg: ParallelConfig, tp_rank: int) -> RankLayout:
    """Where ``tp_rank`` (``0 <= tp_rank < tp_size``) sits; pure arithmetic, no process groups."""
    if not 0 <= tp_rank < cfg.tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {cfg.tp_size})")
    a, m = cfg.attn_tp_size, cfg.moe_tp_size
    groups = group_lists(cfg)

    def member(family: str) -> tuple[int, ...]:
        return tuple(next(g for g in groups[family] if tp_rank in g))

    return RankLayout(
        tp_rank=tp_rank,
        attn_tp_rank=tp_rank % a,
        attn_dp_rank=tp_rank // a,
        ep_rank=tp_rank // m,
        moe_tp_rank=tp_rank % m,
        attn_tp_ranks=member("attn_tp"),
        attn_dp_ranks=member("attn_dp"),
        ep_ranks=member("ep"),
        moe_tp_ranks=member("moe_tp"),
    )


def default_backend(device: str) -> str:
    """``nccl`` for CUDA devices, else ``gloo``."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_distributed(cfg: ParallelConfig, tp_rank: int, init_method: str, *, device: str = "cpu",
                     timeout_s: float = 300.0, backend: str | None = None) -> ParallelState:
    """Join this replica's process group (``tp_size`` ranks) and build its groups.

    Args:
        cfg: validated sizes.
        tp_rank: this process's rank inside its instance replica.
        init_method: ``tcp://host:port`` of the replica's rank 0 (each replica its own port).
        device: ``cpu`` or ``cuda:N``.
        timeout_s: seconds before any collective on any group gives up with an error.
        backend: default :func:`default_backend` of ``device``.

    Returns:
        The rank's :class:`ParallelState` (single-rank default when ``tp_size == 1``).

    Raises:
        ParallelConfigError: impossible sizes. RuntimeError / DistBackendError: peers
        that never arrive within ``timeout_s``.
    """
    validate(cfg)
    if cfg.tp_size == 1:
        return ParallelState(moe_a2a_backend=cfg.moe_a2a_backend, device=str(device))
    backend = backend or default_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend=backend, init_method=init_method, rank=tp_rank,
                            world_size=cfg.tp_size, timeout=timeout)
    return build_parallel_state(cfg, tp_rank, device=device, timeout_s=timeout_s, backend=backend)


def build_parallel_state(cfg: ParallelConfig, tp_rank: int, *, device: str = "cpu", timeout_s: float = 300.0,
                         backend: str | None = None) -> ParallelState:
    """Create the groups of ``cfg`` on the already initialised default group.

    The default group must have exactly ``tp_size`` ranks. Every rank must call
    this with the same ``cfg`` (groups are created collectively, in order).
    Several states may be built over one default group (tests do that).
    """
    validate(cfg)
    if cfg.tp_size == 1:
        return ParallelState(moe_a2a_backend=cfg.moe_a2a_backend, device=str(device))
    world = dist.get_world_size()
    if world != cfg.tp_size:
        raise ParallelConfigError(f"process group has {world} ranks but --tp-size is {cfg.tp_size}")
    backend = backend or default_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    lay = rank_layout(cfg, tp_rank)

    def make(ranks: list[int], bk: str) -> Any:
        return dist.new_group(ranks=ranks, timeout=timeout, backend=bk)

    tp_group = make(list(range(cfg.tp_size)), backend)
    cpu_group = make(list(range(cfg.tp_size)), "gloo")
    mine: dict[str, Any] = {}
    for family, lists in group_lists(cfg).items():
        for ranks in lists:
            # Groups of one rank are never used (the helpers short-cut size 1), but a
            # family is created alike on every rank so the creation order agrees.
            if len(ranks) == 1:
                continue
            if len(ranks) == cfg.tp_size:
                group = tp_group
            else:
                group = make(ranks, backend)
            if tp_rank in ranks:
                mine[family] = group
    # A gloo twin of the attention group for Python-object broadcasts (requests).
    attn_tp_cpu = None
    for ranks in group_lists(cfg)["attn_tp"]:
        if len(ranks) == 1:
            continue
        if backend == "gloo":
            group = mine.get("attn_tp") if tp_rank in ranks else None
        else:
            group = cpu_group if len(ranks) == cfg.tp_size else make(ranks, "gloo")
        if tp_rank in ranks:
            attn_tp_cpu = group
    logger.info("rank %d: attn_tp %s attn_dp %s ep %s moe_tp %s", tp_rank, lay.attn_tp_ranks,
                lay.attn_dp_ranks, lay.ep_ranks, lay.moe_tp_ranks)
    return ParallelState(
        tp_rank=tp_rank, tp_size=cfg.tp_size,
        attn_tp_rank=lay.attn_tp_rank, attn_tp_size=cfg.attn_tp_size,
        attn_dp_rank=lay.attn_dp_rank, attn_dp_size=cfg.attn_dp_size,
        ep_rank=lay.ep_rank, ep_size=cfg.ep_size,
        moe_tp_rank=lay.moe_tp_rank, moe_tp_size=cfg.moe_tp_size,
        tp_group=tp_group, attn_tp_group=mine.get("attn_tp"), attn_dp_group=mine.get("attn_dp"),
        ep_group=mine.get("ep"), moe_tp_group=mine.get("moe_tp"), cpu_group=cpu_group,
        attn_tp_cpu_group=attn_tp_cpu,
        moe_a2a_backend=cfg.moe_a2a_backend, device=str(device),
    )


def destroy_distributed() -> None:
    """Tear down every group of this process (no-op when none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
