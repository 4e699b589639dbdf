"""`shardwise rendezvous`: a port it cannot take is one line, before any signal is touched
(hosting and losing a launcher is tested in tests/e2e/test_elastic.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from shardwise.cli.launch import host_rendezvous
from shardwise.cli.main import main
from shardwise.testing import free_port


def test_a_port_already_hosted_is_refused_in_one_line(capsys):
    port = free_port()
    taken = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=5))  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match=rf"cannot host the rendezvous on 127.0.0.1:{port}"):
            host_rendezvous("127.0.0.1", port)
        assert main(["rendezvous", "--host", "127.0.0.1", "--port", str(port)]) == 2
        said = capsys.readouterr().err
        assert said.startswith("shardwise rendezvous: error: cannot host the rendezvous")
        assert said.count("\n") == 1
    finally:
        del taken
