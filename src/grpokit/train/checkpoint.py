"""Checkpoints that survive crashes: atomic save, checksum manifest, exact resume.

What it does: ``save_checkpoint`` writes ``checkpoints/step-NNNNNN/`` -- the model (safetensors,
``save_pretrained``) and tokenizer, the optimizer state, every random stream (python, numpy,
torch, CUDA, the sampler's generator) and the trainer's counters (step, data position) -- first
into a hidden temporary directory, each file fsynced, then a ``manifest.json`` of SHA-256
checksums, then one atomic ``rename``. A crash or ``kill -9`` at any moment leaves either the
complete new checkpoint or none: the previous one stays loadable. ``find_checkpoint`` verifies the
manifest and refuses a corrupt or partial checkpoint with a message, or (``fallback=True``, what
``--resume auto`` asks for) skips back to the newest good one.

Under torchrun (``dist``): with DDP every rank holds the same weights and optimizer state, so rank
0 writes the checkpoint alone. With FSDP the weights are gathered to rank 0 and written in the same
Hugging Face format (so ``grpokit export`` and ``eval`` read any checkpoint), and the optimizer
state, the large part, is written shard by shard by every rank with torch.distributed.checkpoint
into ``optimizer/``. All ranks write into the same temporary directory, so a multi-node run needs
``train.output_dir`` on a shared file system. The sampler's generator is identical on every rank
(rollout/sampler.py), so rank 0's random streams are everyone's.

What it deliberately does not do: decide when to save (the trainer does), or save a frozen
reference model (it is the initial policy, reloaded from ``model.name_or_path`` on resume); a
reference that moves (``algo.ref_sync_every``) is saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from grpokit.errors import CheckpointError
from grpokit.train import distributed
from grpokit.train.distributed import Dist

FORMAT_VERSION = 1
_PREFIX = "step-"


@dataclass
class TrainerState:
    """The trainer's counters: enough, with the RNG and optimizer state, to continue exactly."""

    step: int
    rows_consumed: int
    num_skipped_steps: int
    before: dict | None  # the held-out evaluation before training, kept for summary.json
    wall_time_s: float  # training time of all segments so far


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{_PREFIX}{step:06d}"


def save_checkpoint(
    run_dir: Path,
    model,
    tokenizer,
    optimizer,
    generator: torch.Generator,
    state: TrainerState,
    keep_last: int,
    ref_model=None,
    dist: Dist | None = None,
) -> Path:
    """Write the checkpoint of ``state.step`` atomically and prune to the newest ``keep_last``.

    ``ref_model`` is saved too when given (a reference that moves, ``algo.ref_sync_every``).
    Under torchrun every rank calls this (``model`` unwrapped from DDP); it returns on every rank
    once the checkpoint is complete.
    """
    d = dist or Dist()
    final = checkpoint_dir(run_dir, state.step)
    parent = final.parent
    tmp = None
    if d.is_main:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".tmp-{final.name}-{os.getpid()}-{time.time_ns()}"
        tmp.mkdir()
    tmp = d.broadcast(tmp)
    weights = ref_weights = None  # None: save_pretrained takes the model's own state dict
    if d.fsdp:  # collectives: every rank takes part
        weights = distributed.full_state_dict(model, d)
        ref_weights = None if ref_model is None else distributed.full_state_dict(ref_model, d)
        distributed.save_sharded_optimizer(model, optimizer, tmp / "optimizer")
    if d.is_main:
        model.save_pretrained(tmp / "model", state_dict=weights)
        if ref_model is not None:
            ref_model.save_pretrained(tmp / "ref", state_dict=ref_weights)
        if not d.fsdp:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        tokenizer.save_pretrained(tmp / "model")
        _commit(tmp, final, generator, state, keep_last)
    d.barrier()
    return final


def _commit(tmp: Path, final: Path, generator: torch.Generator, state: TrainerState, keep_last: int) -> None:
    """Add the random streams and counters, checksum every file, and rename ``tmp`` to ``final``."""
    parent = final.parent
    torch.save(_rng_state(generator), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1))
    _fault_hook(tmp, state.step)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for p in files:
        _fsync(p)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "files": {str(p.relative_to(tmp)): _sha256(p) for p in files},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / "manifest.json")
    if final.exists():  # a checkpoint of this step from an earlier, interrupted attempt
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(parent)
    _prune(parent, keep_last)


def verify(path: Path) -> None:
    """Raise CheckpointError unless every file of the manifest is present with its checksum."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no manifest.json -- a partial checkpoint (the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{path}: manifest.json is unreadable") from None
    for rel, digest in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: {rel} is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{path}: {rel} does not match its checksum (corrupt)")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint directories, oldest first (temporary ones excluded)."""
    parent = run_dir / "checkpoints"
    if not parent.is_dir():
        return []
    found = [
        p for p in parent.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[5:].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def find_checkpoint(path: Path, *, fallback: bool = False, warn=print) -> Path | None:
    """The checkpoint to resume from: ``path`` itself if it is one, else the newest in run dir ``path``.

    A corrupt newest checkpoint raises :class:`CheckpointError`, unless ``fallback`` is set: then
    it is reported through ``warn`` and the next older good one is used. None: no checkpoint at all.
    """
    if (path / "manifest.json").exists() or path.name.startswith(_PREFIX):
        verify(path)
        return path
    candidates = list_checkpoints(path)
    for ckpt in reversed(candidates):
        try:
            verify(ckpt)
            return ckpt
        except CheckpointError as e:
            if not fallback:
                raise CheckpointError(
                    f"{e}. Resume from an older checkpoint explicitly, or use --resume auto to fall back "
                    "to the newest good one"
                ) from None
            warn(f"skipping unusable checkpoint: {e}")
    return None


def load_checkpoint(
    path: Path, model, optimizer, generator: torch.Generator, ref_model=None, dist: Dist | None = None
) -> TrainerState:
    """Restore weights, optimizer, RNG streams (and the reference, if it was saved); return the counters.

    Under torchrun every rank calls this; an FSDP run must resume under FSDP (its optimizer state
    is sharded), any world size.
    """
    d = dist or Dist()
    fsdp_saved = (path / "optimizer").is_dir()
    if fsdp_saved != d.fsdp:
        raise CheckpointError(
            f"{path}: saved {'with' if fsdp_saved else 'without'} FSDP; resume it with "
            f"distributed.strategy={'fsdp under torchrun' if fsdp_saved else 'ddp (or a single process)'}"
        )
    _load_weights(model, path / "model", d)
    if ref_model is not None and (path / "ref").is_dir():
        _load_weights(ref_model, path / "ref", d)
    if d.fsdp:
        distributed.load_sharded_optimizer(model, optimizer, path / "optimizer")
    else:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=False), generator)
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def _load_weights(model, directory: Path, d: Dist) -> None:
    from safetensors.torch import load_file

    device = "cpu" if d.fsdp else str(next(model.parameters()).device)
    weights = {}
    for shard in sorted(directory.glob("*.safetensors")):  # one file, or several shards
        weights.update(load_file(shard, device=device))

    if hasattr(model, "peft_config"):  # a LoRA model saves (and restores) only its adapters
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        if getattr(result, "unexpected_keys", None):
            raise CheckpointError(f"{directory}: adapter weights do not fit ({result.unexpected_keys[:5]})")
        return
    if d.fsdp:  # every rank read the full weights; each keeps its shard
        missing, unexpected = distributed.load_full_state_dict(model, weights)
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}  # tied embeddings are saved once
    if set(missing) - tied or unexpected:
        raise CheckpointError(
            f"{directory}: weights do not fit the model (missing {missing}, unexpected {unexpected})"
        )
    if tied and hasattr(model, "tie_weights"):
        model.tie_weights()


# --------------------------------------------------------------------------------------------


def _rng_state(generator: torch.Generator) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "generator": generator.get_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict, generator: torch.Generator) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _prune(parent: Path, keep_last: int) -> None:
    ckpts = [p for p in parent.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    ckpts.sort(key=lambda p: int(p.name[len(_PREFIX) :]) if p.name[len(_PREFIX) :].isdigit() else -1)
    for old in ckpts[: max(0, len(ckpts) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in parent.glob(".tmp-*"):  # left by a save that was killed
        if str(os.getpid()) not in stale.name:
            shutil.rmtree(stale, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault_hook(tmp: Path, step: int) -> None:
    """Testing hook: with GRPOKIT_TEST_PAUSE_IN_SAVE="STEP:SECONDS", the save of that step announces
    itself (a PAUSED_IN_SAVE file) and pauses half-written, so a test can kill -9 the process
    there (tests/train/test_checkpoint.py). Inert when the variable is unset."""
    spec = os.environ.get("GRPOKIT_TEST_PAUSE_IN_SAVE")
    if spec and int(spec.split(":")[0]) == step:
        (tmp.parent / "PAUSED_IN_SAVE").write_text(str(os.getpid()))
        time.sleep(float(spec.split(":")[1]))


class StopOnSignal:
    """While active, SIGINT / SIGTERM only set ``signum``: the loop stops at the end of the step.

    A second signal while stopping restores the default behaviour (a second Ctrl-C kills).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
        self.signum = signum

    def __enter__(self) -> StopOnSignal:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals stay as they are
            self._old = {}
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
