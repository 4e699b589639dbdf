"""Applying a plan: `wrap(model, config)` and what it leaves behind.

apply.py holds wrap's one documented order; ddp.py and fsdp.py apply the two engines;
stages.py cuts the model into this rank's pipeline stages and pipeline.py steps them over
the schedule; experts.py spreads a mixture of experts' experts over the ep ranks;
recompute.py and autocast.py apply activation checkpointing and autocast; batch_stats.py,
global_batch.py and router_loss.py make losses built from statistics of the batch (a
mixture of experts' load balancing) whole-batch ones and say what stays per rank;
materialize.py builds meta models for real; weights.py loads safetensors into local
shards; context.py cuts each call's sequences under context parallel and ulysses.py
computes their attention; wrapped.py is the record of what wrap did, read by every layer above.
"""

from shardwise.parallelize.apply import check_not_wrapped, wrap
from shardwise.parallelize.autocast import apply_autocast
from shardwise.parallelize.batch_stats import BatchStatisticNotice
from shardwise.parallelize.from_env import translation_from_env
from shardwise.parallelize.fsdp import sync_module_states
from shardwise.parallelize.global_batch import global_batch_sum
from shardwise.parallelize.materialize import InitializationError, has_meta, init_empty, materialize
from shardwise.parallelize.pipeline import pipeline_eval, pipeline_step
from shardwise.parallelize.recompute import apply_activation_checkpointing, is_checkpointed
from shardwise.parallelize.ulysses import context_attention
from shardwise.parallelize.weights import INDEX_FILE, SINGLE_FILE, WeightsError, load_weights
from shardwise.parallelize.wrapped import (
    WrapInfo,
    mark_replaced,
    stale_parameters,
    unwrap,
    wrap_info,
)

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "BatchStatisticNotice",
    "InitializationError",
    "WeightsError",
    "WrapInfo",
    "apply_activation_checkpointing",
    "apply_autocast",
    "check_not_wrapped",
    "context_attention",
    "global_batch_sum",
    "has_meta",
    "init_empty",
    "is_checkpointed",
    "load_weights",
    "mark_replaced",
    "materialize",
    "pipeline_eval",
    "pipeline_step",
    "stale_parameters",
    "sync_module_states",
    "translation_from_env",
    "unwrap",
    "wrap",
    "wrap_info",
]
