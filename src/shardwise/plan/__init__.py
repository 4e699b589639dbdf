"""Wrap planning: policies decide units, the plan records them, strategies apply them."""

from shardwise.plan.detect import DetectedBlocks, detect_blocks
from shardwise.plan.planner import MixedUnit, PlanNotice, WrapPlan, WrapUnit, plan_wrap
from shardwise.plan.policies import (
    Policy,
    register_wrap_policy,
    registered_policies,
    resolve_policy,
)

__all__ = [
    "DetectedBlocks",
    "MixedUnit",
    "PlanNotice",
    "Policy",
    "WrapPlan",
    "WrapUnit",
    "detect_blocks",
    "plan_wrap",
    "register_wrap_policy",
    "registered_policies",
    "resolve_policy",
]
