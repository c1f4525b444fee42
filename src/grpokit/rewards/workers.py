"""A process pool with a hard per-task timeout: a task that runs too long is killed, not waited for.

What it does: ``WorkerPool(num_workers, timeout_s).map(fn, items)`` runs ``fn(item)`` for every
item in worker processes (spawned, so no fork-after-threads hazards; a worker imports ``fn``'s
module before its first task, outside the timeout) and returns one
:class:`TaskResult` per item, in order: the value, the exception text, or a timeout. A timed-out
or crashed worker is killed and replaced; the other tasks of the batch carry on. Workers live
until :meth:`close` (or interpreter exit), so their imports are paid once.

Why processes and not threads: math-verify's parser uses ``signal.alarm`` and raises outside the
main thread, and a runaway computation (``9^{9^{9^{9^9}}}``) cannot be interrupted in a thread at all.

What it deliberately does not do: sandboxing. Workers run with the trainer's privileges; code
from completions goes through ``rewards.sandbox`` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from grpokit.errors import ConfigError


@dataclass
class TaskResult:
    ok: bool
    value: Any = None
    error: str | None = None  # "timeout" or the exception's last line
    timed_out: bool = False


def _worker_main(conn: Connection) -> None:
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        if isinstance(task, str):  # warm-up: import the task's module before any deadline runs
            importlib.import_module(task)
            conn.send((True, None))
            continue
        fn, item = task
        try:
            conn.send((True, fn(item)))
        except BaseException as e:  # report everything; the parent decides
            conn.send((False, f"{type(e).__name__}: {e}" if str(e) else traceback.format_exc(limit=1)))


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.modules: set[str] = set()

    def warm(self, module: str, limit_s: float = 300.0) -> None:
        """Import ``module`` in the worker, so start-up and imports never count against a task's timeout."""
        if module in self.modules:
            return
        self.conn.send(module)
        if not self.conn.poll(limit_s):
            raise RuntimeError(f"a reward worker took over {limit_s} s to import {module}")
        self.conn.recv()
        self.modules.add(module)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class WorkerPool:
    """``num_workers`` spawned processes; every task gets at most ``timeout_s`` seconds of wall time."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0) -> None:
        if num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self.num_killed = 0
        atexit.register(self.close)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[TaskResult]:
        """Run ``fn(item)`` for each item (``fn`` must be importable: a module-level function)."""
        results: list[TaskResult | None] = [None] * len(items)
        while len(self._workers) < min(self.num_workers, max(len(items), 1)):
            self._workers.append(_Worker(self._ctx))
        pending = list(range(len(items)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker index -> (item index, deadline)
        while pending or busy:
            for w, worker in enumerate(self._workers):
                if w not in busy and pending:
                    worker.warm(fn.__module__)
                    i = pending.pop()
                    worker.conn.send((fn, items[i]))
                    busy[w] = (i, time.monotonic() + self.timeout_s)
            now = time.monotonic()
            next_deadline = min(deadline for _, deadline in busy.values())
            ready = wait([self._workers[w].conn for w in busy], timeout=max(0.0, next_deadline - now))
            for w in list(busy):
                worker, (i, deadline) = self._workers[w], busy[w]
                if worker.conn in ready:
                    try:
                        ok, payload = worker.conn.recv()
                        results[i] = TaskResult(True, payload) if ok else TaskResult(False, error=payload)
                    except EOFError:  # the worker died (e.g. killed by the OOM killer)
                        results[i] = TaskResult(False, error="worker process died")
                        self._replace(w)
                    del busy[w]
                elif time.monotonic() >= deadline:
                    results[i] = TaskResult(False, error=f"timeout after {self.timeout_s} s", timed_out=True)
                    self._replace(w)
                    del busy[w]
        return results  # type: ignore[return-value]

    def _replace(self, w: int) -> None:
        self._workers[w].kill()
        self.num_killed += 1
        self._workers[w] = _Worker(self._ctx)

    def close(self) -> None:
        for worker in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                worker.conn.send(None)
            worker.proc.join(timeout=2)
            if worker.proc.is_alive():
                worker.proc.kill()
        self._workers = []


_SHARED: dict[tuple[int, float], WorkerPool] = {}


def shared_pool(num_workers: int, timeout_s: float) -> WorkerPool:
    """One pool per (size, timeout) for the whole process: rewards built again and again (every
    evaluation, every test) reuse warm workers instead of spawning new ones."""
    key = (num_workers, float(timeout_s))
    if key not in _SHARED:
        _SHARED[key] = WorkerPool(num_workers, timeout_s)
    return _SHARED[key]
