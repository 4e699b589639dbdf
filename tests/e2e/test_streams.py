"""A streamed corpus through `shardwise run`: a datasets stream, packed, in 2 DataLoader
workers, stopped and resumed at world 2 (the same batches, bit for bit), at worlds 1 and 4
(every document's tokens trained exactly as often as without the stop, each step the same
tokens), and at another worker count (works where it divides, else one line)."""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
from _proc import run_in_session

pytestmark = pytest.mark.streams
pytest.importorskip("datasets")

WORKER = Path(__file__).with_name("_stream_worker.py")
STOP = 4  # optimizer steps before the stop


def launch(run_dir: Path, nproc: int, *args: str):
    cmd = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", str(nproc), str(WORKER),
           str(run_dir), *args]  # fmt: skip
    return run_in_session(cmd, timeout_s=300)


def ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def read(run_dir: Path, nproc: int) -> list[dict]:
    return [json.loads((run_dir / f"rows.{r}.json").read_text()) for r in range(nproc)]


def tokens(*runs: list[dict]) -> Counter:
    """Tokens trained per document (a token of document i is 1 + i)."""
    count: Counter = Counter()
    for ranks in runs:
        for rank in ranks:
            for batch in rank["rows"]:
                for row in batch:
                    count.update(row)
    return count


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streams")
    ok(launch(tmp / "whole", 2))
    ok(launch(tmp / "stopped", 2, "--max-steps", str(STOP)))
    return tmp


def resumed(runs: Path, name: str, nproc: int, *args: str):
    run_dir = runs / name
    shutil.copytree(runs / "stopped", run_dir)
    return launch(run_dir, nproc, "--resume", "latest", *args), run_dir


def test_a_resume_at_the_same_world_trains_the_same_batches_bit_for_bit(runs):
    result, run_dir = resumed(runs, "again", 2)
    ok(result)
    whole, stopped, again = read(runs / "whole", 2), read(runs / "stopped", 2), read(run_dir, 2)
    assert whole[0]["steps"] > 2 * STOP
    for r in range(2):
        assert stopped[r]["rows"] + again[r]["rows"] == whole[r]["rows"]
    assert stopped[0]["losses"] + again[0]["losses"] == whole[0]["losses"]


@pytest.mark.parametrize(("nproc", "workers"), [(1, 2), (4, 2)])
def test_a_resume_at_another_world_trains_each_document_as_often(runs, nproc, workers):
    result, run_dir = resumed(runs, f"world{nproc}", nproc, "--workers", str(workers))
    ok(result)
    assert f"data-parallel ranks 2 -> {nproc}" in result.stderr
    whole, stopped, later = read(runs / "whole", 2), read(runs / "stopped", 2), read(run_dir, nproc)
    assert tokens(stopped, later) == tokens(whole)  # 0 duplicated, 0 missing
    # The global batch in tokens is kept: each step takes 2 ranks x 2 rows x 2 micro-batches.
    assert later[0]["accumulate_steps"] * nproc == 2 * 2  # was 2 at 2 ranks
    assert all(len(batch) == 2 for rank in later for batch in rank["rows"])
    assert later[0]["steps"] == whole[0]["steps"]
    # Each step takes the same rows as without the stop: the same losses, up to the order of
    # float sums (which SGD then amplifies, slowly).
    tail = whole[0]["losses"][STOP:]
    assert later[0]["losses"][:8] == pytest.approx(tail[:8], rel=1e-5)
    assert later[0]["losses"] == pytest.approx(tail, rel=1e-3)


def test_another_worker_count_that_divides_works_and_one_that_does_not_is_one_line(runs):
    result, run_dir = resumed(runs, "workers4", 2, "--workers", "4")
    ok(result)
    assert tokens(read(runs / "stopped", 2), read(run_dir, 2)) == tokens(read(runs / "whole", 2))
    result, _ = resumed(runs, "workers3", 2, "--workers", "3")
    assert result.returncode != 0
    lines = [ln for ln in result.stderr.splitlines() if "num_workers=3" in ln]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "(the checkpoint was saved with 2)" in lines[0] and "reads 4 part(s)" in lines[0]
