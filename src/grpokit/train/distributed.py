"""torchrun data parallelism: process group, DDP / FSDP2 wrapping, and the few collectives the loop needs.

What it does: ``init_distributed`` reads torchrun's environment (``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``) and starts the process group (``nccl`` with CUDA, else ``gloo``); without torchrun
it returns a single-process :class:`Dist` whose collectives are identities, so the trainer has
one code path. ``wrap`` returns the module the update runs through: a
``DistributedDataParallel`` wrapper (``strategy: ddp``) or the model itself after FSDP2
``fully_shard`` of every decoder layer and the root (``strategy: fsdp``).

The rules the trainer follows, and why:
- A group never spans ranks: rank r owns prompts ``[r * P / W, (r + 1) * P / W)`` of each step,
  and the sampler draws every rank's uniforms from one global block, so each rank samples the
  completions a single process would have sampled for its rows (rollout/sampler.py).
- Under FSDP every forward is a collective (it all-gathers the layer's parameters), so every rank
  must run the same number of forward passes: micro-batch plans are padded to the longest rank's
  (:meth:`Dist.pad_plan`, under DDP too), and generation runs with the parameters unsharded
  (:func:`full_parameters`), because ranks decode for different numbers of steps.
- Gradients are synchronised once per optimizer step (:func:`grad_sync`, off for every micro-batch
  but the last). DDP and FSDP average over ranks, while grpokit normalises each rank's loss by the
  *global* token / sequence counts, so the loss is multiplied by W: the synchronised gradient is
  then exactly the single-process gradient of the whole batch.

- A process that ran a process group leaves through :func:`exit_process` (the command line does):
  a process group that FSDP2 still references outlives ``destroy_process_group``, and its gloo
  worker threads can still be releasing a collective's tensors when the interpreter finalizes; a
  thread that comes back for the GIL then aborts the process (``terminate called without an
  active exception``, exit -6: pytorch/pytorch#179291), after a run that had finished and saved.

What it deliberately does not do: launch processes (torchrun does), pipeline or tensor
parallelism, or anything multi-node beyond torchrun's own rendezvous.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from grpokit.errors import ConfigError


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. ``world_size == 1``: no process group, no collectives."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "ddp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        return self.enabled and self.strategy == "fsdp"

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank if self.enabled else torch.cuda.current_device())
        return torch.device("cpu")

    # -- collectives (identities in a single process) ------------------------------------------
    def all_gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.enabled:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks, in float64."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def max(self, value: float) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def pad_plan(self, plan: list[list[int]]) -> list[list[int]]:
        """Pad ``plan`` with empty micro-batches (``[]``: a forward on a stand-in row whose loss counts
        0) to the longest rank's length. FSDP needs it (every forward is a collective); DDP needs
        every rank to reach the one synchronised backward of an optimizer step, even with no rows."""
        if not self.enabled:
            return plan
        longest = int(self.max(float(len(plan))))
        return plan + [[] for _ in range(longest - len(plan))]


def init_distributed(strategy: str = "ddp", backend: str = "auto") -> Dist:
    """Start the process group when run under torchrun (``WORLD_SIZE`` > 1); else a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Dist(strategy=strategy)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("distributed.backend=nccl needs CUDA GPUs; use gloo (or auto) on CPU")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    global _group_started
    _group_started = True
    return Dist(rank, world_size, local_rank, strategy)


_group_started = False  # init_distributed started (or joined) a process group in this process


def group_started() -> bool:
    return _group_started


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` the way ``sys.exit`` would -- exit handlers run, stdout and
    stderr flushed -- but without interpreter finalization, where a collective's worker thread
    still holding Python tensors aborts the process (module docstring). Files the run wrote are
    closed by then (``with`` blocks, the logger's ``close``)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks (FSDP2 shards each one as a unit): the largest
    ``ModuleList`` in the model (``model.layers`` for Llama / Qwen2, ``h`` for GPT-2 ...)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ConfigError(f"{type(model).__name__}: no ModuleList of layers found to shard with FSDP")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def shard(model) -> None:
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, norm, head), in place."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)


def wrap(model, d: Dist):
    """The module the update's forward/backward runs through (the model itself in one process).

    DDP: buffers are not synced in forward (``forward_sync_buffers``, formerly
    ``broadcast_buffers``): they are constants (rotary frequencies), and a sync would make every
    forward a collective. FSDP: the model is sharded in place, and is
    its own training module.
    """
    if not d.enabled:
        return model
    if d.strategy == "fsdp":
        shard(model)
        return model
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    ids = [d.local_rank] if torch.cuda.is_available() else None
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = {"forward_sync_buffers" if newer else "broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=ids, **no_sync)


def unwrap(module):
    """The model under a DDP wrapper (FSDP2 keeps the model's own class)."""
    return getattr(module, "module", module)


@contextlib.contextmanager
def grad_sync(module, enabled: bool):
    """Gradient synchronisation for the backward passes inside: DDP ``no_sync`` / FSDP2
    ``set_requires_gradient_sync(False)`` when not ``enabled``; nothing in a single process."""
    if enabled:
        yield
        return
    if hasattr(module, "no_sync"):  # DDP
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def _fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_parameters(model, d: Dist):
    """Inside, an FSDP model holds its full parameters on every rank and its forward passes issue
    no collectives, so ranks may decode for different numbers of steps (generation, evaluation).
    Costs one unsharded copy of the parameters while active. A no-op without FSDP."""
    mods = _fsdp_modules(model) if d.fsdp else []
    for m in mods:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in mods:
            # back to FSDP2's own settings: the root unit (embeddings, norm, head) stays whole after
            # its forward, for the backward that follows it (and the loss's head, fused_head_reason)
            m.set_reshard_after_forward(m is not model, recurse=False)
            m.reshard()


def full_state_dict(model, d: Dist) -> dict | None:
    """The model's full (unsharded) state dict on rank 0's CPU, None on other ranks (a collective
    under FSDP); the plain ``state_dict()`` otherwise."""
    if not d.fsdp:
        return unwrap(model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if d.is_main else None


def load_full_state_dict(model, state: dict) -> tuple[list[str], list[str]]:
    """Load a full state dict (every rank passes the same one) into a sharded FSDP model; returns
    the (missing, unexpected) keys, as ``load_state_dict(strict=False)`` does."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return list(result.missing_keys), list(result.unexpected_keys)


def save_sharded_optimizer(model, optimizer, path) -> None:
    """FSDP: each rank writes its shard of the optimizer state with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))


def load_sharded_optimizer(model, optimizer, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
