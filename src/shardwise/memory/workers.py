"""Running a simulation's independent traces side by side, in forked processes.

Owns: the simulations' jobs as generators (a generator yields a list of traces it needs,
each as simulate_step's arguments, and is sent back their reports in order; its return
value is its answer), `gather` (several such generators as one, their traces asked
together), `drive` (answering a generator's requests until it returns) and `run_jobs`
(one batch of traces: in this process one after another, or each in a forked child, at
most `workers` at a time).

Why forked children. A plan simulates several strategies, each as two short traces (the
fast path) or several pipeline stages: dozens of traces that share nothing, each a few
seconds of Python under fake tensors, which one interpreter runs on one core. A forked
child starts with the parent's imports and its models on meta already built, so it costs
milliseconds, and it needs nothing pickled but its report. Every trace runs exactly as it
would in this process (the same function on the same arguments), so the figures are the
same to the byte whatever the number of workers.

Where it does not fork: off Linux (fork is unsafe with macOS frameworks), with one job or
one worker, and inside a forked child (no nesting). The caller decides when a trace must
run in a spawned subprocess instead (a process group of its own already exists).

Must not: change a trace's arguments or its report, or leave a child running: a child
that runs over the timeout, dies or raises is named, the others are killed, and the
error is raised here (the child's own exception, with its traceback as the cause).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Generator
from multiprocessing.connection import wait
from typing import Any

import torch

__all__ = ["Job", "default_workers", "drive", "gather", "in_background", "run_jobs"]

Job = Generator[list[dict[str, Any]], list[Any], Any]
"""A simulation's job: yields the traces it needs, is sent their reports, returns its answer."""

_IN_CHILD = False


class ChildTraceback(Exception):
    """The traceback of an exception raised in a forked trace (the cause of the one raised)."""


def can_fork() -> bool:
    return sys.platform.startswith("linux") and not _IN_CHILD


MAX_DEFAULT_WORKERS = 4
"""The default's ceiling: a plan runs up to workers + 2 processes of about 0.5 GiB each,
which stays under 4 GiB of host memory; `workers=N` asks for more."""


def default_workers() -> int:
    """The CPUs this process may run on, at most MAX_DEFAULT_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(cpus, MAX_DEFAULT_WORKERS)


def check_workers(workers: int | None) -> int:
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(
            f"simulate_step(workers={workers!r}): give the number of traces to run side by "
            "side, an int >= 1 (1: one after another in this process), or None for the CPUs "
            "this process may use."
        )
    return workers


def _child(conn: Any, run: Callable[[dict[str, Any]], Any], job: dict[str, Any]) -> None:
    global _IN_CHILD
    _IN_CHILD = True
    # The parent's OpenMP threads are not in the fork: a parallel region would wait for
    # them for ever. One thread runs every op inline (fake tensors compute next to nothing).
    torch.set_num_threads(1)
    try:
        conn.send(("ok", run(job), ""))
    except BaseException as exc:  # sent back and raised in the parent
        text = traceback.format_exc()
        try:
            conn.send(("raise", exc, text))
        except Exception:  # an exception that does not pickle: its text
            conn.send(("error", f"{type(exc).__name__}: {exc}", text))
    finally:
        conn.close()


def _describe(job: dict[str, Any]) -> str:
    config = job.get("config")
    what = f"strategy={getattr(config, 'strategy', '?')}"
    if job.get("stage") is not None:
        what += f", pipeline stage {job['stage'].index}"
    if job.get("segments") is not None:
        what += f", the run cut to {job['segments'][1]} blocks"
    return what


def _receive(reader: Any, proc: Any, died: str, failed: str) -> Any:
    """A forked child's answer from `reader` (closed after), once it is ready: its report,
    or its exception raised here with its traceback as the cause; `died` (with {code}) if
    it sent nothing, `failed` before the text of an exception that did not pickle."""
    try:
        status, payload, text = reader.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(died.format(code=proc.exitcode)) from None
    finally:
        reader.close()
    proc.join(5)
    if status == "raise":
        raise payload from ChildTraceback(text)
    if status == "error":
        raise RuntimeError(f"{failed}: {payload}") from ChildTraceback(text)
    return payload


def run_jobs(
    jobs: list[dict[str, Any]],
    run: Callable[[dict[str, Any]], Any],
    workers: int,
    timeout_s: float,
) -> list[Any]:
    """`run(job)` for each job, in order: in forked children, `workers` at a time, where
    more than one job and worker and fork allows (the first here when there are more jobs
    than workers); else here, one after another."""
    if workers <= 1 or len(jobs) <= 1 or not can_fork():
        return [run(job) for job in jobs]
    ctx = mp.get_context("fork")
    results: list[Any] = [None] * len(jobs)
    waiting = list(enumerate(jobs))
    running: dict[Any, tuple[int, Any, float]] = {}
    reader: Any

    def start(index: int, job: dict[str, Any]) -> None:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(writer, run, job), daemon=True)
        proc.start()
        writer.close()
        running[reader] = (index, proc, time.monotonic())

    try:
        if len(jobs) > workers:
            # `workers` children start now, and this process traces the first job beside
            # them: the children started after it inherit what it leaves warm (lazy
            # imports, fake tensors' dispatch cache), which makes each of theirs about a
            # fifth cheaper. (One process more than workers for that while.)
            first = waiting.pop(0)
            for _ in range(workers):
                start(*waiting.pop(0))
            results[first[0]] = run(first[1])
        while waiting or running:
            while waiting and len(running) < workers:
                start(*waiting.pop(0))
            oldest = min(started for _, _, started in running.values())
            left = timeout_s - (time.monotonic() - oldest)
            ready = wait(list(running), timeout=max(left, 0.0))
            if not ready and left <= 0:
                index = next(i for i, _, s in running.values() if s == oldest)
                raise TimeoutError(
                    f"simulate_step: the trace of {_describe(jobs[index])} ran over "
                    f"{timeout_s}s in its forked worker (simulate_step(timeout_s=...))."
                )
            for reader in ready:
                index, proc, _ = running.pop(reader)
                what = _describe(jobs[index])
                results[index] = _receive(
                    reader,
                    proc,
                    f"simulate_step: the forked worker tracing {what} died (exit code "
                    "{code}) before sending its report.",
                    f"simulate_step: tracing {what} failed",
                )
    finally:
        for reader, (_, proc, _) in running.items():
            proc.kill()
            proc.join()
            reader.close()
    return results


def in_background(fn: Callable[[], Any], what: str, timeout_s: float) -> Callable[[], Any]:
    """`fn()` started now in a forked child, where fork allows, beside what this process
    does next; returns the function that waits for its answer (raising its error, or
    naming `what` if it dies or runs over `timeout_s`). Elsewhere `fn` runs when that
    function is called."""
    if not can_fork():
        return fn
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(writer, lambda _: fn(), {}), daemon=True)
    proc.start()
    writer.close()
    started = time.monotonic()

    def answer() -> Any:
        try:
            if not reader.poll(max(0.0, timeout_s - (time.monotonic() - started))):
                raise TimeoutError(f"{what} ran over {timeout_s}s in its forked worker.")
            return _receive(
                reader, proc, f"the forked worker of {what} died (exit code {{code}}).", what
            )
        finally:
            reader.close()
            if proc.is_alive():
                proc.kill()
                proc.join()

    return answer


def gather(jobs: list[Job]) -> Job:
    """Several jobs as one: each round asks every unfinished job's traces together;
    returns their answers in order."""
    answers: list[Any] = [None] * len(jobs)
    asking: dict[int, list[dict[str, Any]]] = {}
    for i, job in enumerate(jobs):
        try:
            asking[i] = next(job)
        except StopIteration as done:
            answers[i] = done.value
    while asking:
        order = [(i, k) for i, wanted in asking.items() for k in range(len(wanted))]
        reports = yield [asking[i][k] for i, k in order]
        mine: dict[int, list[Any]] = {i: [] for i in asking}
        for (i, _), report in zip(order, reports, strict=True):
            mine[i].append(report)
        for i in list(asking):
            try:
                asking[i] = jobs[i].send(mine[i])
            except StopIteration as done:
                answers[i] = done.value
                del asking[i]
    return answers


def drive(job: Job, runs: Callable[[list[dict[str, Any]]], list[Any]]) -> Any:
    """`job`'s answer, each of its requests answered by `runs`."""
    try:
        wanted = next(job)
        while True:
            wanted = job.send(runs(wanted))
    except StopIteration as done:
        return done.value
