"""Adapters for the trainers people already run: mmengine's Runner and Lightning's Trainer.

Each host gets one module here, importable only with its optional extra installed
(`pip install shardwise[mmengine]`, `shardwise[lightning]`). `import shardwise` never
imports a host; these modules translate the host's words and calls into `ParallelConfig`,
`shardwise.wrap`, the loss contract and the checkpoint functions, and nothing else.
"""
