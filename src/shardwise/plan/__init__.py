"""The wrap plan as data, safe on the meta device: what will be sharded, before anything is.

detect.py finds a model's repeated blocks; policies.py is the registry of wrap policies;
units.py assigns every parameter to one unit (ties, frozen splits, keep_fp32); planner.py
builds the printable `WrapPlan` (`plan_wrap`). parallelize/ applies it.
"""

from shardwise.plan.detect import DetectedBlocks, detect_blocks
from shardwise.plan.planner import MixedUnit, PlanNotice, WrapPlan, WrapUnit, plan_wrap
from shardwise.plan.policies import (
    Policy,
    PolicyFactory,
    register_wrap_policy,
    registered_policies,
    resolve_policy,
)
from shardwise.plan.stages import StagePlan, plan_stages

__all__ = [
    "DetectedBlocks",
    "MixedUnit",
    "PlanNotice",
    "Policy",
    "PolicyFactory",
    "StagePlan",
    "WrapPlan",
    "WrapUnit",
    "detect_blocks",
    "plan_stages",
    "plan_wrap",
    "register_wrap_policy",
    "registered_policies",
    "resolve_policy",
]
