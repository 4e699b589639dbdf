"""Wrap planning: policies decide units, the plan records them, strategies apply them."""

from shardwise.wrap.plan import WrapPlan, WrapUnit, plan_wrap
from shardwise.wrap.policies import resolve_policy

__all__ = ["WrapPlan", "WrapUnit", "plan_wrap", "resolve_policy"]
