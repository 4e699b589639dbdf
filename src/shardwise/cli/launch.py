"""`shardwise run` and `shardwise demo`: torch's elastic launcher, as torchrun, with checks.

Owns: the launcher's arguments (validated before anything spawns), translating them into
torchrun's, and running torch's launcher with shardwise's environment (the launcher's pid,
the collective timeout).

Must not: launch processes itself (torch's elastic agent does).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardwise.cli.grace import GRACE_S


def nproc_arg(value: str) -> int:
    if value == "auto":
        import torch

        return torch.cuda.device_count() or 2  # the GPUs, or 2 CPU processes
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--nproc={value!r}: use a positive integer or 'auto'"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--nproc={n}: use a positive integer or 'auto'")
    return n


def visible_gpus() -> int:
    """GPUs this machine shows to its processes (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def fit_nproc(nproc: int | None, gpus: int, *, default: int, command: str) -> tuple[int, str]:
    """(processes per node, a line to print or ''), checked before anything spawns.

    Each rank of a CUDA job needs a GPU of its own: NCCL stops at init with "Duplicate GPU
    detected" when two share one. `nproc=None` takes `default`, capped at the GPUs.
    """
    if nproc is None:
        if gpus and gpus < default:
            return gpus, (
                f"shardwise {command}: {gpus} GPU(s) visible, so {gpus} process(es) instead "
                f"of {default} (one per GPU; two ranks cannot share a GPU under NCCL)."
            )
        return default, ""
    if gpus and nproc > gpus:
        raise ValueError(
            f"shardwise {command}: --nproc {nproc} but this machine has {gpus} GPU(s) "
            f"visible, and each rank needs its own (NCCL stops with 'Duplicate GPU "
            f"detected'). Use --nproc {gpus} (or fewer), or run on CPU with the GPUs hidden: "
            f"CUDA_VISIBLE_DEVICES='' shardwise {command} ..."
        )
    return nproc, ""


def nnodes_arg(value: str) -> str:
    """--nnodes: N, or MIN:MAX for an elastic job (torchrun's syntax)."""
    lo, sep, hi = value.partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        low = high = 0
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(
            f"--nnodes={value!r}: use a positive integer N, or MIN:MAX with 1 <= MIN <= MAX "
            "(an elastic job that starts with MIN nodes and admits up to MAX)"
        )
    return f"{low}:{high}" if sep else str(low)


def non_negative_arg(flag: str) -> Any:
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = -1
        if n < 0:
            raise argparse.ArgumentTypeError(f"{flag}={value!r}: use a whole number >= 0")
        return n

    return parse


def seconds_arg(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = -1.0
    if not 0 < s < float("inf"):  # an infinite timeout fails in every worker's timedelta
        raise argparse.ArgumentTypeError(
            f"--timeout={value!r}: use a positive number of seconds (the collective timeout)"
        )
    return s


def grace_arg(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = -1.0
    if not 0 <= s < float("inf"):
        raise argparse.ArgumentTypeError(
            f"--grace={value!r}: use a number of seconds >= 0 (how long the other workers may "
            "run on after one fails; 0 stops them at once)"
        )
    return s


def _max_nodes(nnodes: str | int) -> int:
    return int(str(nnodes).rpartition(":")[2])


# torchrun reads PET_<FLAG> as the default of each of its flags (torch/distributed/
# argparse_util.py's `env` action): a flag given on the command line wins, then the
# variable, then the flag's own default. Kubeflow Trainer's torch runtime sets these five
# and starts torchrun with no flags, so `shardwise run` there must read them the same way:
# without this, PET_NPROC_PER_NODE=3 started 2 ranks and nothing listened on
# PET_MASTER_PORT. (flag, variable, parser, default when neither is given)
_PET_FLAGS: tuple[tuple[str, str, str, Any, Any], ...] = (
    ("nproc", "--nproc", "PET_NPROC_PER_NODE", nproc_arg, "auto"),
    ("nnodes", "--nnodes", "PET_NNODES", nnodes_arg, "1"),
    ("node_rank", "--node-rank", "PET_NODE_RANK", non_negative_arg("--node-rank"), "0"),
)


def _master_port_arg(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"use a port number in [1, 65535], got {value!r}")
    return port


def resolve_env_defaults(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Fill the `run` flags left unset from torchrun's PET_* variables, then the defaults.

    A malformed variable is one ValueError naming it, before anything spawns. The
    rendezvous endpoint is PET_MASTER_ADDR:PET_MASTER_PORT (the address defaults to
    127.0.0.1, as torchrun's --master-addr does) when the port is set and
    --rdzv-endpoint is not; node rank 0 hosts its store, as torchrun's static rendezvous
    has rank 0 host it (`args.rdzv_host`). Calling it twice changes nothing.
    """
    env = os.environ if environ is None else environ
    for attr, flag, var, parse, default in _PET_FLAGS:
        if getattr(args, attr, None) is not None:
            continue  # the flag was given: it beats the variable, as in torchrun
        value = env.get(var)
        if value is None:
            setattr(args, attr, parse(default))
            continue
        try:
            setattr(args, attr, parse(value))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(
                f"{var}={value!r} (the default of {flag}, as torchrun reads it): {exc}. "
                f"Fix the variable or give {flag}; nothing was started."
            ) from None
    if getattr(args, "rdzv_endpoint", None) is None and "PET_MASTER_PORT" in env:
        value = env["PET_MASTER_PORT"]
        try:
            port = _master_port_arg(value)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(
                f"PET_MASTER_PORT={value!r} (the rendezvous port, as torchrun reads it): "
                f"{exc}. Fix the variable or give --rdzv-endpoint HOST:PORT; nothing was "
                "started."
            ) from None
        addr = env.get("PET_MASTER_ADDR") or "127.0.0.1"
        args.rdzv_endpoint = f"{addr}:{port}"
        args.rdzv_host = args.node_rank == 0
    elif getattr(args, "rdzv_endpoint", None) is None and env.get("PET_MASTER_ADDR"):
        raise ValueError(
            f"PET_MASTER_ADDR={env['PET_MASTER_ADDR']!r} without PET_MASTER_PORT: set the "
            "port too (the rendezvous endpoint is ADDR:PORT), or give --rdzv-endpoint "
            "HOST:PORT; nothing was started."
        )
    return args


def launcher_args(args: argparse.Namespace) -> list[str]:
    """torchrun's arguments for our `run` flags (single node: --standalone)."""
    resolve_env_defaults(args)
    nnodes = str(args.nnodes)
    out = ["--nproc_per_node", str(args.nproc), "--nnodes", nnodes]
    if _max_nodes(nnodes) == 1 and not args.rdzv_endpoint:
        out.append("--standalone")
    else:
        if not args.rdzv_endpoint:
            raise ValueError(
                f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node) "
                "so the nodes can find each other."
            )
        if ":" not in nnodes and not 0 <= args.node_rank < int(nnodes):
            raise ValueError(
                f"--node-rank={args.node_rank} must be in [0, --nnodes={nnodes}): give each "
                "node's launcher its own number, 0 on the first."
            )
        out += [
            "--node_rank",
            str(args.node_rank),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            args.rdzv_endpoint,
        ]
        rdzv_host = getattr(args, "rdzv_host", None)
        if rdzv_host is not None:
            # The endpoint came from PET_MASTER_*: under Kubeflow it is node 0's service
            # name, which torch's guess (the endpoint matches this machine's hostname or
            # addresses) may not recognise, and then no node would host the store.
            out += ["--rdzv_conf", f"is_host={int(rdzv_host)}"]
        # torch keys a rendezvous by this id: two jobs on one store with the same id (its
        # default is 'none') would join one job. Every node of a SLURM job shares its id.
        rdzv_id = getattr(args, "rdzv_id", None) or os.environ.get("SLURM_JOB_ID")
        if rdzv_id:
            out += ["--rdzv_id", str(rdzv_id)]
    out += ["--max_restarts", str(args.max_restarts)]
    return out


# torch's elastic agent by default hosts one TCPStore for the whole run and hands it to
# every worker generation (TORCHELASTIC_USE_AGENT_STORE). A restart re-runs
# init_process_group against the same store, where the dead generation's keys are still
# set: the process group's prefix ("default_pg/0/") does not change between restarts, so
# a new rank can read a dead peer's Gloo address ("connectFullMesh failed ... Connection
# refused") or count stale keys in a store barrier (a hang). With the sharing switched
# off, each rendezvous round hands out a fresh port and worker rank 0 hosts a new, empty
# store (dynamic_rendezvous.py, next_rendezvous). Measured with bench/soak.py (rank 1
# SIGKILLed at a random step, torch 2.13, 2 CPU ranks): with sharing 8 of 12 trials
# resumed (3 died in connectFullMesh, 1 hung); without it 8 of 8, each with one restart.
# See pytorch#135712. An explicit value set by the user is kept.
#
# SIGUSR1 joins the signals torch's agent turns into a shutdown (SIGTERM, SIGINT, SIGHUP,
# SIGQUIT by default; torchrun's --signals-to-handle, read from this variable): SLURM
# sends it before a time limit or a preemption (`--signal`), and
# its default action would end the launcher at once and its workers with it, unsaved. The
# agent passes it on to the workers, whose Runner saves and exits 75 as on SIGTERM.
_LAUNCH_ENV = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",  # --signals-to-handle
}


def launch_torchrun(
    torchrun_args: list[str], *, timeout_s: float | None = None, grace_s: float = GRACE_S
) -> int:
    """Run torch's elastic launcher in this process with `torchrun_args`.

    When a worker fails, the others get `grace_s` seconds to end on their own before they
    are stopped (cli/grace.py). Failures are reported by cli/report.py: each worker error
    once with its ranks, a rank that ended by a signal named with it, the ranks stopped
    because another ended in one line, and each restart with its attempt number.
    """
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from shardwise.cli.grace import FailureGrace
    from shardwise.cli.interrupt import InterruptedShutdown
    from shardwise.cli.report import AgentLogReader, failures_from_torch, preempted, summary
    from shardwise.distributed.process_group import LAUNCHER_PID_ENV, TIMEOUT_ENV
    from shardwise.train.resume import PREEMPTED_EXIT_CODE

    # The agent runs in this process and its workers inherit this environment.
    for key, value in _LAUNCH_ENV.items():
        os.environ.setdefault(key, value)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # workers die with us (init_distributed)
    if timeout_s is not None:
        os.environ[TIMEOUT_ENV] = repr(timeout_s)
    with tempfile.TemporaryDirectory(prefix="shardwise-run-") as log_dir:
        # The workers' error files land here (attempt_N/LOCAL_RANK/error.json).
        args = get_args_parser().parse_args(["--log-dir", log_dir, *torchrun_args])
        grace = FailureGrace(grace_s)
        interrupt = InterruptedShutdown()
        try:
            with grace, interrupt, AgentLogReader(grace.attempts):
                run(args)
        except ChildFailedError as exc:
            stopped = grace.attempts[-1].stopped if grace.attempts else None
            failures = failures_from_torch(exc.failures)
            print(summary(failures, stopped=stopped), file=sys.stderr, flush=True)
            if preempted(failures):
                # A stop signal reached the workers (here or on another node) and not this
                # launcher: the job is preempted, not failed. Say so in the exit code a
                # scheduler requeues on (SLURM's RequeueExit).
                print(
                    f"shardwise run: exiting with {PREEMPTED_EXIT_CODE}, as the workers did "
                    "(no restart left here): start again with resume='latest'.",
                    file=sys.stderr,
                    flush=True,
                )
                return PREEMPTED_EXIT_CODE
            if grace.refused_restart:
                print(
                    "shardwise run: not restarted: every rank refused its setting, and a "
                    "restart would refuse it again.",
                    file=sys.stderr,
                    flush=True,
                )
            return 1
        except SignalException as exc:
            # A scheduler reclaiming the node: torchrun forwarded the signal to the workers
            # and waited for them; under the Runner they saved a checkpoint and exited 75.
            if exc.sigval in (signal.SIGTERM, signal.SIGUSR1):
                print(
                    f"shardwise run: {signal.Signals(exc.sigval).name}: the workers were "
                    "stopped; a Runner saves a "
                    f"checkpoint and exits with {PREEMPTED_EXIT_CODE} (start again with "
                    "resume='latest').",
                    file=sys.stderr,
                )
                return PREEMPTED_EXIT_CODE
            if exc.sigval == signal.SIGINT:
                return _after_ctrl_c(interrupt.exit_codes)
            print(f"shardwise run: stopped by signal {exc.sigval}", file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0


def _after_ctrl_c(exit_codes: dict[int, int | None]) -> int:
    """The launcher's exit code after a SIGINT, and its line when the workers said nothing:
    a Runner's rank 0 has said where it stopped when every worker exited 75 (saved after
    its step: the first Ctrl-C) or 130 (stopped at once: the second)."""
    from shardwise.train.resume import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

    codes = set(exit_codes.values())
    if codes == {PREEMPTED_EXIT_CODE}:
        return PREEMPTED_EXIT_CODE
    if codes and codes <= {PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE}:
        return INTERRUPTED_EXIT_CODE
    print(
        "shardwise run: stopped by SIGINT (Ctrl-C); no Runner saved a checkpoint",
        file=sys.stderr,
        flush=True,
    )
    return 128 + signal.SIGINT


def _config_arg(script_args: list[str]) -> str | None:
    for i, arg in enumerate(script_args):
        if arg == "--config" and i + 1 < len(script_args):
            return script_args[i + 1]
        if arg.startswith("--config="):
            return arg.partition("=")[2]
    return None


def check_overrides(script_args: list[str]) -> None:
    """The script's `section.key=value` arguments whose section is one of shardwise's
    Config (parallel, train, optimizer, scheduler, runner, adapter), before anything spawns,
    with or without `--config FILE`: an unknown key is the error the workers' `load_config`
    would raise (the closest key, the valid ones), and a value of the wrong type too.
    Other arguments are the script's own and are left alone."""
    import dataclasses

    from shardwise.config.overrides import check_override
    from shardwise.config.run_file import Config

    sections = {f.name for f in dataclasses.fields(Config)}
    for arg in script_args:
        key, eq, _ = arg.partition("=")
        if eq and not arg.startswith("-") and key.partition(".")[0] in sections and "." in key:
            check_override(arg)


def check_layout(script_args: list[str], world: int) -> None:
    """The script's `parallel` section against the world size, before anything spawns.

    Only when the script is given `--config FILE` (its own default file is unknown here):
    the file's `parallel` section and any `parallel.*=` overrides are read as shardwise's
    ParallelConfig, and its layout is resolved for `world`. A file that is not a mapping or
    has no `parallel` section is the script's own business and is left alone."""
    from shardwise.config.run_file import Config, apply_overrides, from_dict, read_yaml
    from shardwise.distributed.mesh import resolve_mesh

    path = _config_arg(script_args)
    if path is None:
        return
    try:
        text = Path(path).read_text()
    except OSError:
        return  # the script reports its own file
    data = read_yaml(text, path)
    if not isinstance(data, dict) or not isinstance(data.get("parallel"), dict):
        return
    overrides = [a for a in script_args if a.startswith("parallel.") and "=" in a]
    section = apply_overrides({"parallel": data["parallel"]}, overrides)
    parallel = from_dict(Config, section).parallel
    if parallel.strategy == "auto" or parallel.device_mesh is not None:
        return
    try:
        resolve_mesh(
            parallel.strategy,
            parallel.dp_shard,
            world,
            tp=parallel.tp_size,
            pp=parallel.pp,
            ep=parallel.ep,
            cp=parallel.cp,
        )
    except ValueError as exc:
        raise ValueError(
            f"{path}{' with ' + ' '.join(overrides) if overrides else ''} at world size "
            f"{world}: {exc} Nothing was started."
        ) from None


def check_foreign(source: str, world: int | None) -> None:
    """Read another tool's config before anything spawns: every refused key is an error
    here, nothing started; the workers get its path (`SHARDWISE_FROM`)."""
    from shardwise.config.foreign import read_foreign
    from shardwise.distributed.process_group import FOREIGN_CONFIG_ENV

    path = os.path.abspath(source)
    translation = read_foreign(path, world=world)
    try:
        translation.config  # noqa: B018  (a ConfigError naming every refused key)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}\nNothing was started.") from None
    counts = {v: sum(r.verdict == v for r in translation.rows) for v in ("exact", "differs")}
    print(
        f"shardwise run: {translation.source} config {source}: {len(translation.rows)} keys, "
        f"{counts['exact']} exact, {counts['differs']} with a stated difference (shardwise "
        f"config show --from {source} lists them)",
        file=sys.stderr,
        flush=True,
    )
    os.environ[FOREIGN_CONFIG_ENV] = path


def run_command(args: argparse.Namespace) -> int:
    torchrun = launcher_args(args)  # the launcher's own words first
    if not args.module and not os.path.isfile(args.script):
        raise FileNotFoundError(
            f"{args.script!r} is not a file (from {os.getcwd()}); nothing was started. Give "
            "the script's path, or -m MODULE for a module."
        )
    check_overrides(args.script_args)  # a misspelt key: one line, and nothing starts
    fit_nproc(args.nproc, visible_gpus(), default=args.nproc, command="run")
    elastic = ":" in str(args.nnodes)  # an elastic job's world is not known yet
    if getattr(args, "source", None):
        check_foreign(args.source, None if elastic else args.nproc * int(args.nnodes))
    if not elastic:
        check_layout(args.script_args, args.nproc * int(args.nnodes))
    target = ["-m", args.script] if args.module else [args.script]
    return launch_torchrun(
        [*torchrun, *target, *args.script_args], timeout_s=args.timeout, grace_s=args.grace
    )


def demo_command(args: argparse.Namespace) -> int:
    passthrough = (["--short"] if args.short else []) + (
        ["--config", args.config] if args.config else []
    )
    nproc, note = fit_nproc(args.nproc, visible_gpus(), default=2, command="demo")
    if note:
        print(note, file=sys.stderr, flush=True)
    if nproc == 1:
        from shardwise.cli.demo import main as demo_main

        return demo_main([*passthrough, *args.overrides])
    torchrun = ["--nproc_per_node", str(nproc), "--standalone"]
    return launch_torchrun([*torchrun, "-m", "shardwise.cli.demo", *passthrough, *args.overrides])


def host_rendezvous(host: str, port: int) -> int:
    """Host torch's TCPStore for an elastic job's c10d rendezvous until stopped (SIGINT or
    SIGTERM). By default the first launcher on the endpoint's machine hosts it, and the job
    is lost with that launcher; a store of its own, on a machine that outlives the nodes,
    lets any node leave. A launcher on this machine finds the port taken and joins as a
    client (torch's c10d backend tries that next)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    try:
        store = TCPStore(
            host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
    except (RuntimeError, ValueError) as exc:
        raise RuntimeError(f"cannot host the rendezvous on {host}:{port}: {exc}") from None
    stop = {"signal": 0}

    def request_stop(signum: int, frame: object) -> None:
        stop["signal"] = signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    print(
        f"shardwise rendezvous: hosting the store on {host}:{port}; give every node "
        f"`shardwise run --nnodes MIN:MAX --rdzv-endpoint {host}:{port}`. One job per store "
        "(or jobs with different --rdzv-id): start it with the job, stop it (Ctrl-C) after.",
        file=sys.stderr,
        flush=True,
    )
    while not stop["signal"]:
        signal.pause()
    del store
    return 0
