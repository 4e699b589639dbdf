# An mmengine config trained by shardwise's FSDP2: the only shardwise lines are
# `custom_imports` (registers ShardwiseDataParallel) and `model_wrapper_cfg`.
custom_imports = dict(imports=["shardwise.integrations.mmengine", "toy_modules"])
default_scope = "mmengine"

model = dict(type="ToyNet", hidden=64)
model_wrapper_cfg = dict(
    type="ShardwiseDataParallel",
    strategy="full_shard",  # or 'ddp', 'shard_grad_op', 'hybrid_shard'; FSDP1 words work too
    mixed_precision="fp32",  # 'bf16' on GPUs
)

loader = dict(
    dataset=dict(type="ToyClassification", size=256),
    sampler=dict(type="DefaultSampler", shuffle=True),
    batch_size=8,
    num_workers=0,
    collate_fn=dict(type="default_collate"),
)
train_dataloader = loader
val_dataloader = dict(loader, sampler=dict(type="DefaultSampler", shuffle=False))
val_evaluator = dict(type="ToyAccuracy")

train_cfg = dict(by_epoch=False, max_iters=40, val_interval=20)
val_cfg = dict()
optim_wrapper = dict(
    type="OptimWrapper",
    optimizer=dict(type="AdamW", lr=1e-2),
    accumulative_counts=2,
    clip_grad=dict(max_norm=1.0),  # by the global norm over all shards
)
default_hooks = dict(
    checkpoint=dict(type="CheckpointHook", interval=20, by_epoch=False),
    logger=dict(type="LoggerHook", interval=10),
)
env_cfg = dict(dist_cfg=dict(backend="gloo"))  # 'nccl' on GPUs
randomness = dict(seed=0)
launcher = "pytorch"
work_dir = "work_dirs/toy_mmengine"
