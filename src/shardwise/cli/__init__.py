"""The `shardwise` command line: `run`, `plan`, `demo`, `config`, `plot`, `checkpoint`.

`main` is the console script; `python -m shardwise.cli` runs it too.
"""

from shardwise.cli.launch import launcher_args
from shardwise.cli.main import build_parser, main

__all__ = ["build_parser", "launcher_args", "main"]
