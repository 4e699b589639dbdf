"""Memory answers before any run: estimates, the activation trace, simulation, `auto`.

model_states.py estimates parameter, gradient and optimizer state per rank; activations.py
traces what autograd saves; simulate.py runs one step on fake tensors over a fake process
group; auto.py picks the cheapest plan that fits; fake.py holds the fake world they share.
"""

from shardwise.memory.activations import ActivationTrace, BlockTrace, trace_activations
from shardwise.memory.auto import (
    AC_ORDER,
    COMM_ORDER,
    DEFAULT_FRACTION,
    AutoPlan,
    Candidate,
    InstantPeak,
    NoPlanFitsError,
    choose_plan,
    device_memory,
    format_rows,
    resolve_budget,
)
from shardwise.memory.fake import ExampleInput
from shardwise.memory.model_states import (
    OPTIMIZER_STATES,
    MemoryEstimate,
    PeakEstimate,
    dtype_bytes,
    estimate_memory,
    estimate_peak,
    format_bytes,
    format_memory,
    memory_json,
)
from shardwise.memory.simulate import (
    SimOptimizerFactory,
    SimReport,
    real_step,
    simulate_step,
    simulate_steps,
    tracked_step,
)

__all__ = [
    "AC_ORDER",
    "COMM_ORDER",
    "DEFAULT_FRACTION",
    "OPTIMIZER_STATES",
    "ActivationTrace",
    "AutoPlan",
    "BlockTrace",
    "Candidate",
    "ExampleInput",
    "InstantPeak",
    "MemoryEstimate",
    "NoPlanFitsError",
    "PeakEstimate",
    "SimOptimizerFactory",
    "SimReport",
    "choose_plan",
    "device_memory",
    "dtype_bytes",
    "estimate_memory",
    "estimate_peak",
    "format_bytes",
    "format_memory",
    "format_rows",
    "memory_json",
    "real_step",
    "resolve_budget",
    "simulate_step",
    "simulate_steps",
    "trace_activations",
    "tracked_step",
]
