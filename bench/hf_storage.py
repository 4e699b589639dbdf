"""Consolidated weights: torch DCP's HuggingFaceStorageWriter/Reader against shardwise.weights.

A GPT is sharded with full_shard over `--world` CPU ranks (gloo). Two methods are compared,
each run in fresh ranks, `--repeats` times, alternating which goes first:

- export, shardwise: `shardwise.export_weights(model, out)`: one tensor at a time is
  gathered to CPU and rank 0 writes Hugging Face-layout safetensors;
- export, torch: `dcp.save(state_dict, storage_writer=HuggingFaceStorageWriter(out,
  save_distributed=True, enable_consolidation=True))`: every rank writes its shards to
  out/sharded/, then rank 0 stitches them into consolidated files (the `finish` step);
- load, shardwise: `shardwise.load_weights(model, path)`: each rank reads its own slices;
- load, torch: `dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(path))`.

torch's writer refuses tied weights (safetensors rejects two names on one storage), so the
torch paths leave out the tied aliases (the names `named_parameters()` drops), as
`save_pretrained` does. Every run starts after an `os.sync()`. Reported per run: wall
time of the slowest rank, and that plus a following `os.sync()`; per rank, peak RSS
(VmHWM) and peak anonymous RSS (RssAnon, sampled every 5 ms by a separate process) above
the level just before the call, with glibc's mmap threshold pinned as in
bench/overhead.py; the 1-minute load average before the run (the machine is shared).
`--smoke` runs everything in one group of ranks, so its memory figures are less clean.
Checked: the tensors each method writes or loads are torch.equal, name by name, to the
other method's and to the source; the files each writes (names, sizes, index, header
metadata). Then a tiny transformers GPT2LMHeadModel, built from a config, is exported both
ways and opened with `AutoModelForCausalLM.from_pretrained`, and the logits are compared
with the original's; each loader is also tried on transformers' own `save_pretrained`
output.

    python bench/hf_storage.py                        # 110 M and 570 M GPTs, world 2 (~6 min)
    python bench/hf_storage.py --sizes 110m --repeats 3 --no-transformers
    python bench/hf_storage.py --smoke
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig

SIZES = {
    "tiny": GPTConfig(vocab_size=256, seq_len=128, d_model=64, n_heads=1, n_layers=2),
    # bench/checkpoint_io.py's model (109.7 M parameters)
    "110m": GPTConfig(vocab_size=32_000, seq_len=128, d_model=768, n_heads=12, n_layers=12),
    # bench/meta_memory.py's model (570 M parameters, 2175 MiB of fp32)
    "570m": GPTConfig(vocab_size=32_000, seq_len=512, d_model=2048, n_heads=16, n_layers=10),
}
METHODS = ("shardwise", "torch")


# --- the two methods ----------------------------------------------------------------


def _tied_aliases(model: nn.Module) -> set[str]:
    """Second and later names of a parameter registered under several (tied weights)."""
    from shardwise.parallelize import unwrap

    module = unwrap(model)
    every = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return every - {n for n, _ in module.named_parameters()}


def _torch_state(model: nn.Module, drop_aliases: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    if not drop_aliases:
        return state
    aliases = _tied_aliases(model)
    return {k: v for k, v in state.items() if k not in aliases}


class _TimedWriter(HuggingFaceStorageWriter):
    """torch's writer, consolidating, with `finish` (rank 0's consolidation pass) timed."""

    last_finish_s: float | None = None

    def __init__(self, out: str) -> None:
        super().__init__(path=out, save_distributed=True, enable_consolidation=True)

    def finish(self, metadata: Any, results: Any) -> None:
        start = time.perf_counter()
        super().finish(metadata, results)
        _TimedWriter.last_finish_s = time.perf_counter() - start


def _export(method: str, model: nn.Module, out: str, drop_aliases: bool = True) -> None:
    if method == "shardwise":
        shardwise.export_weights(model, out)
        return
    import torch.distributed.checkpoint as dcp

    state = _torch_state(model, drop_aliases)
    dcp.save(state, storage_writer=_TimedWriter(out))


def _load(method: str, model: nn.Module, path: str, drop_aliases: bool = True) -> None:
    if method == "shardwise":
        shardwise.load_weights(model, path)
        return
    import torch.distributed.checkpoint as dcp

    # dcp.load copies into the DTensors get_model_state_dict returns: the parameters' own
    # local shards, so no set_model_state_dict is needed.
    dcp.load(_torch_state(model, drop_aliases), storage_reader=HuggingFaceStorageReader(path))


# --- measuring, in the ranks ------------------------------------------------------------


_SAMPLER = """
import select, sys
path, peak = f"/proc/{sys.argv[1]}/status", 0
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.005)[0]:
    for line in open(path):
        if line.startswith("RssAnon:"):
            peak = max(peak, int(line.split()[1]) * 1024)
print(peak, flush=True)
"""


class _AnonPeak:
    """Peak RssAnon of this process, sampled every 5 ms by a separate process.

    A thread would miss peaks: safetensors' `save` holds the GIL while it builds the file in
    a buffer and then copies it into a bytes object (2x the data for a moment).
    """

    def __enter__(self) -> _AnonPeak:
        self.peak = 0
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._proc.stdout is None or self._proc.stdout.readline() != "ready\n":
            raise RuntimeError("the RssAnon sampler process did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._proc.communicate("stop", timeout=60)
        self.peak = int(out.split()[-1])


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def _measure(fn: Callable[[], None]) -> dict[str, Any]:
    """Wall time and peak memory of `fn()` above the level just before it, on this rank,
    and the time an `os.sync()` then takes (writes still in the page cache reach the disk).
    """
    os.sync()  # the previous run's dirty pages are not written back during this one
    gc.collect()
    dist.barrier()
    load_before = _loadavg()
    before = common.proc_status_bytes("VmRSS") or 0
    anon_before = common.proc_status_bytes("RssAnon") or 0
    common.reset_rss_peak()
    with _AnonPeak() as anon:
        wall, _ = common.timed(fn)
    peak = common.rss_peak_bytes() - before
    sync_s, _ = common.timed(os.sync, barrier=True)
    return {
        "wall_s": wall,
        "sync_after_s": sync_s,
        "peak_rss": peak,
        "anon_peak": max(anon.peak, common.proc_status_bytes("RssAnon") or 0) - anon_before,
        "rss_before": before,
        "loadavg_1min_before": load_before,
    }


def _sharded_gpt(cfg: GPTConfig, weights: str | None) -> nn.Module:
    with shardwise.init_empty():
        model = GPT(cfg)
    return shardwise.wrap(model, shardwise.ParallelConfig(strategy="full_shard"), weights=weights)


def _local_pieces(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    state: dict[str, Any] = get_model_state_dict(model)
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def _unequal_pieces(a: nn.Module, b: nn.Module) -> list[str]:
    pa, pb = _local_pieces(a), _local_pieces(b)
    return sorted(k for k in pa if not torch.equal(pa[k], pb[k]))


def _export_run(cfg: GPTConfig, method: str, source: str, out: str) -> dict[str, Any]:
    model = _sharded_gpt(cfg, source)
    _TimedWriter.last_finish_s = None
    result = _measure(lambda: _export(method, model, out))
    result["finish_s"] = _TimedWriter.last_finish_s
    result["local_param_bytes"] = sum(
        p.to_local().numel() * p.element_size()  # type: ignore[attr-defined]  # DTensors
        for p in model.parameters()
    )
    return result


def _load_run(cfg: GPTConfig, method: str, source: str, out: str | None) -> dict[str, Any]:
    del out
    model = _sharded_gpt(cfg, None)  # initialised, so a load that does nothing shows
    result = _measure(lambda: _load(method, model, source))
    # Against the other method, loaded into a second model after the measurement.
    other = _sharded_gpt(cfg, None)
    _load("torch" if method == "shardwise" else "shardwise", other, source)
    result["unequal_to_other_method"] = _unequal_pieces(model, other)
    reference = _sharded_gpt(cfg, source)  # wrap(weights=...), shardwise's own path
    result["unequal_to_source"] = _unequal_pieces(model, reference)
    return result


Job = tuple[str, GPTConfig, str, str, str | None]  # phase, model, method, source, out


def _jobs_rank(jobs: list[Job]) -> list[dict[str, Any]]:
    """Run export/load jobs one after another in this group of ranks."""
    common.pin_malloc_thresholds()
    run: dict[str, Callable[..., dict[str, Any]]] = {"export": _export_run, "load": _load_run}
    results = []
    for phase, cfg, method, source, out in jobs:
        results.append(run[phase](cfg, method, source, out))
        gc.collect()
    return results


def _execute(jobs: list[Job], world: int, one_group: bool) -> list[list[dict[str, Any]]]:
    """Per job, the ranks' results: each job in fresh ranks, or all in one group (fast,
    for --smoke: memory figures are then less clean)."""
    if one_group:
        ranks = run_distributed(_jobs_rank, world, args=(jobs,), timeout_s=1200)
        return [[r[i] for r in ranks] for i in range(len(jobs))]
    return [
        [r[0] for r in run_distributed(_jobs_rank, world, args=([j],), timeout_s=1200)]
        for j in jobs
    ]


def _reference_weights(cfg: GPTConfig, out: str) -> str:
    """The source model (seed 0, unwrapped), written by export_weights."""
    torch.manual_seed(0)
    return str(shardwise.export_weights(GPT(cfg), out))


# --- files, in the parent -------------------------------------------------------------


def _layout(out: Path) -> dict[str, Any]:
    """What a method wrote: files and sizes, the index's shape, the header metadata."""
    from safetensors import safe_open

    files = {
        str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()
    }
    layout: dict[str, Any] = {"files": files, "total_bytes": sum(files.values())}
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        layout["index"] = {
            "keys": sorted(data),
            "metadata": data.get("metadata"),
            "files_in_weight_map": sorted(set(data["weight_map"].values())),
            "entries": len(data["weight_map"]),
        }
    headers = {}
    for p in sorted(out.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            headers[p.name] = f.metadata()
    layout["header_metadata"] = headers
    return layout


def _compare_weights(a: Path, b: Path) -> dict[str, Any]:
    """torch.equal per tensor name between two exported directories (one tensor at a time)."""
    from safetensors import safe_open

    from shardwise.parallelize.weights import _weight_files

    fa, fb = _weight_files(a), _weight_files(b)
    shared = sorted(set(fa) & set(fb))  # tensor names in both
    unequal = []
    for name in shared:
        with safe_open(str(fa[name]), framework="pt") as f:
            ta = f.get_tensor(name)
        with safe_open(str(fb[name]), framework="pt") as f:
            tb = f.get_tensor(name)
        if ta.dtype != tb.dtype or not torch.equal(ta, tb):
            unequal.append(name)
        del ta, tb
    return {
        "common": len(shared),
        "unequal": unequal,
        "only_in_first": sorted(set(fa) - set(fb)),
        "only_in_second": sorted(set(fb) - set(fa)),
        "identical_common": not unequal,
    }


def _uptime() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return ""


def _run_summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {
        "wall_s": round(max(r["wall_s"] for r in ranks), 3),
        "wall_then_sync_s": round(
            max(r["wall_s"] for r in ranks) + max(r["sync_after_s"] for r in ranks), 3
        ),
        "peak_rss_MiB_per_rank": [common.mib(r["peak_rss"]) for r in ranks],
        "anon_peak_MiB_per_rank": [common.mib(r["anon_peak"]) for r in ranks],
        "rss_before_MiB_per_rank": [common.mib(r["rss_before"]) for r in ranks],
        "loadavg_1min_before": max(r["loadavg_1min_before"] for r in ranks),
    }
    finish = [r["finish_s"] for r in ranks if r.get("finish_s") is not None]
    if finish:
        summary["of_which_consolidation_s"] = round(max(finish), 3)
    return summary


def _ranges(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """[min, max] over runs: of the wall time, and per rank of each memory figure."""

    def per_rank(key: str) -> list[list[float]]:
        columns = zip(*(r[key] for r in runs), strict=True)
        return [[min(c), max(c)] for c in columns]

    walls = [r["wall_s"] for r in runs]
    synced = [r["wall_then_sync_s"] for r in runs]
    return {
        "wall_s": [min(walls), max(walls)],
        "wall_s_median": statistics.median(walls),
        "wall_then_sync_s": [min(synced), max(synced)],
        "peak_rss_MiB_per_rank": per_rank("peak_rss_MiB_per_rank"),
        "anon_peak_MiB_per_rank": per_rank("anon_peak_MiB_per_rank"),
    }


def _bench_size(
    name: str, cfg: GPTConfig, world: int, repeats: int, root: Path, one_group: bool
) -> dict[str, Any]:
    work = root / name
    work.mkdir(parents=True)
    source_dir = work / "source"
    _reference_weights(cfg, str(source_dir))
    gc.collect()
    with torch.device("meta"):
        params = GPT(cfg).num_params()
    result: dict[str, Any] = {
        "params": params,
        "model_MiB": common.mib(params * 4),
        "export": {m: [] for m in METHODS},
        "load": {m: [] for m in METHODS},
        "export_checks": [],
        "load_checks": [],
    }
    for rep in range(repeats):
        order = METHODS if rep % 2 == 0 else METHODS[::-1]
        outs = {m: work / f"export-{m}-{rep}" for m in METHODS}
        jobs: list[Job] = [("export", cfg, m, str(source_dir), str(outs[m])) for m in order]
        jobs += [("load", cfg, m, str(source_dir), None) for m in order]
        for (phase, _, method, _, _), ranks in zip(
            jobs, _execute(jobs, world, one_group), strict=True
        ):
            result[phase][method].append(_run_summary(ranks))
            if phase == "load":
                result["load_checks"].append(
                    {
                        "repeat": rep,
                        "method": method,
                        "unequal_to_other_method": sorted(
                            {n for r in ranks for n in r["unequal_to_other_method"]}
                        ),
                        "unequal_to_source": sorted(
                            {n for r in ranks for n in r["unequal_to_source"]}
                        ),
                    }
                )
        if rep == 0:
            result["layout"] = {m: _layout(outs[m]) for m in METHODS}
        result["export_checks"].append(
            {
                "repeat": rep,
                "torch_vs_shardwise": _compare_weights(outs["torch"], outs["shardwise"]),
                **{f"{m}_vs_source": _compare_weights(outs[m], source_dir) for m in METHODS},
            }
        )
        for out in outs.values():
            shutil.rmtree(out)
    result["summary"] = {
        phase: {m: _ranges(result[phase][m]) for m in METHODS} for phase in ("export", "load")
    }
    for phase in ("export", "load"):
        s = result["summary"][phase]
        result["summary"][phase]["torch_over_shardwise_wall_median"] = round(
            s["torch"]["wall_s_median"] / s["shardwise"]["wall_s_median"], 3
        )
    shutil.rmtree(work)
    return result


# --- transformers: can it open what each method writes? ------------------------------


def _gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)


def _gpt2(seed: int) -> Any:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(_gpt2_config()).eval()


def _first_line(exc: BaseException) -> str:
    """The root cause in one line (DCP wraps each rank's exception in CheckpointException)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}"[:300]


def _hf_rank(root: str) -> dict[str, Any]:
    config = shardwise.ParallelConfig(strategy="full_shard")
    model: Any = shardwise.wrap(_gpt2(0), config)
    rank = dist.get_rank()
    results: dict[str, Any] = {"export_errors": {}, "load": {}}
    for method, drop in (("shardwise", True), ("torch", True), ("torch_plain", False)):
        out = f"{root}/{method}"
        try:
            _export(method.removesuffix("_plain"), model, out, drop_aliases=drop)
        except (Exception, CheckpointException) as exc:  # recorded, not fatal
            results["export_errors"][method] = _first_line(exc)
            continue
        if rank == 0:
            model.config.save_pretrained(out)
    for source in ("shardwise", "torch", "save_pretrained"):
        if source in results["export_errors"]:
            continue
        for method, drop in (("shardwise", True), ("torch", True), ("torch_plain", False)):
            fresh = shardwise.wrap(_gpt2(1), config)
            key = f"{method} <- {source}"
            try:
                _load(method.removesuffix("_plain"), fresh, f"{root}/{source}", drop)
            except (Exception, CheckpointException) as exc:  # a BaseException
                results["load"][key] = _first_line(exc)
                continue
            bad = _unequal_pieces(fresh, model)
            results["load"][key] = "identical" if not bad else f"differs: {bad[:5]}"
    return results


def _bench_transformers(world: int, root: Path) -> dict[str, Any]:
    import transformers
    from transformers import AutoModelForCausalLM

    work = root / "transformers"
    work.mkdir(parents=True)
    original = _gpt2(0)
    original.save_pretrained(work / "save_pretrained")
    ranks = run_distributed(_hf_rank, world, args=(str(work),), timeout_s=600)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = original(tokens).logits
    result: dict[str, Any] = {
        "transformers": transformers.__version__,
        "model": "GPT2LMHeadModel, vocab 256, n_embd 64, 2 layers, 2 heads (tied lm_head)",
        "export_errors": ranks[0]["export_errors"],
        "from_pretrained": {},
        "loads": {k: sorted({r["load"][k] for r in ranks}) for k in ranks[0]["load"]},
        "layout": {},
    }
    for method in ("shardwise", "torch", "torch_plain"):
        out = work / method
        if method in result["export_errors"]:
            continue
        result["layout"][method] = sorted(
            str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()
        )
        try:
            opened: Any = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
            loaded, info = opened
        except Exception as exc:
            result["from_pretrained"][method] = {"error": _first_line(exc)}
            continue
        with torch.no_grad():
            logits = loaded.eval()(tokens).logits
        result["from_pretrained"][method] = {
            "opens": True,
            "class": type(loaded).__name__,
            "loading_info": {k: sorted(v) for k, v in info.items() if v},
            "logits_equal": torch.equal(logits, expected),
            "logits_max_abs_diff": float((logits - expected).abs().max()),
        }
    return result


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--sizes", default="110m,570m", help=f"some of {tuple(SIZES)}")
    parser.add_argument("--repeats", type=int, default=2, help="runs per method and phase")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--no-transformers", action="store_true", help="skip the GPT-2 part")
    common.add_dir_arg(parser)
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny size, once, in one group of ranks"
    )
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.repeats = "tiny", 1
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {tuple(SIZES)}")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    common.pin_malloc_thresholds()  # the parent builds the source model; give its memory back
    result: dict[str, Any] = {
        **common.report_header("hf_storage", common.command_line("bench/hf_storage.py")),
        "world": args.world,
        "cpus": os.cpu_count(),
        "loadavg_start": _uptime(),
        "sizes": {},
    }
    start = time.perf_counter()
    with common.work_dir(args.dir, "shardwise-hf-storage-") as root:
        for name in sizes:
            result["sizes"][name] = _bench_size(
                name, SIZES[name], args.world, args.repeats, root, args.smoke
            )
        if not args.no_transformers:
            result["transformers"] = _bench_transformers(args.world, root)
    result["loadavg_end"] = _uptime()
    result["wall_s"] = round(time.perf_counter() - start, 1)
    common.emit_json(result)


if __name__ == "__main__":
    main()
