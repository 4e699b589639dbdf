"""torchtitan's pipeline micro-batches: local_batch_size // pipeline_parallel_microbatch_size.

Owns: `microbatches`, which adds `pp_microbatches` and its rows to a torchtitan translation
(config/torchtitan.py reads the rest of the file).

Must not: import torchtitan, or read the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.config.translation import Row, Translation

__all__ = ["microbatches"]


_LOCAL_BATCH = 8
"""torchtitan's training.local_batch_size where the file is silent (shardwise's too)."""


_MICROBATCH_SIZE = 1
"""torchtitan's parallelism.pipeline_parallel_microbatch_size where the file is silent."""


def microbatches(out: Translation, data: dict[str, Any]) -> None:
    """torchtitan splits each local batch into local_batch_size // microbatch_size pipeline
    micro-batches, and refuses a micro-batch size that does not divide the batch."""
    p = data.get("parallelism")
    p = p if isinstance(p, Mapping) else {}
    pp = int(p.get("pipeline_parallel_degree", 1))
    if "num_pp_microbatches" in p:
        count = int(p["num_pp_microbatches"])
        if count > 1 and pp > 1:
            out.parallel["pp_microbatches"] = count
        out.rows.append(Row("parallelism.num_pp_microbatches", count,
                            f"parallel.pp_microbatches={count}", "exact"))  # fmt: skip
    key = "parallelism.pipeline_parallel_microbatch_size"
    if "pipeline_parallel_microbatch_size" in p:
        size = p["pipeline_parallel_microbatch_size"]
    elif pp > 1 and "num_pp_microbatches" not in p:
        size = _MICROBATCH_SIZE  # the file is silent: torchtitan's micro-batches of 1 row
        key = f"{key} (torchtitan's default)"
    else:
        return
    if pp == 1:
        out.rows.append(Row(key, size, "-", "no effect", "pp is 1"))
        return
    training = data.get("training")
    training = training if isinstance(training, Mapping) else {}
    local_key = next((k for k in ("local_batch_size", "batch_size") if k in training), None)
    local = int(training[local_key]) if local_key else _LOCAL_BATCH
    named = (
        f"training.{local_key}={local}"
        if local_key
        else f"training.local_batch_size={local} (torchtitan's default)"
    )
    if int(size) < 1 or local % int(size) != 0:
        divisors = ", ".join(str(d) for d in range(1, local + 1) if local % d == 0)
        why = (
            f"does not divide {named} (torchtitan refuses it too); give a divisor of {local} "
            f"({divisors})"
        )
        out.rows.append(Row(key, size, "-", "refused", why))
        return
    count = local // int(size)
    if "num_pp_microbatches" in p and int(p["num_pp_microbatches"]) != count:
        why = f"{named} // {size} = {count} micro-batches, and num_pp_microbatches says otherwise"
        out.rows.append(Row(key, size, "-", "refused", why))
        return
    out.parallel["pp_microbatches"] = count
    out.rows.append(Row(key, size, f"parallel.pp_microbatches={count}", "exact",
                        f"{named} // {size}, as torchtitan splits the local batch"))  # fmt: skip
