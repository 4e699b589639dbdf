"""`shardwise plan`'s MODULE:FACTORY: a dotted module name, or the path of a .py file
(issue 50: `g3/llamas.py:llama8b` said "No module named 'g3/llamas'" with no hint)."""

from __future__ import annotations

import sys

from shardwise.cli import main

FACTORY = (
    "import torch\n"
    "from helper import WIDTH\n"  # a neighbour imported as `python path/to/file.py` would
    "def small():\n    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH))\n"
)


def test_a_path_to_a_py_file_is_imported_with_its_neighbours(tmp_path, monkeypatch, capsys):
    (tmp_path / "g3").mkdir()
    (tmp_path / "g3" / "llamas.py").write_text(FACTORY)
    (tmp_path / "g3" / "helper.py").write_text("WIDTH = 6\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "llamas", raising=False)
    monkeypatch.delitem(sys.modules, "helper", raising=False)
    assert main(["plan", "g3/llamas.py:small", "--world", "2"]) == 0
    assert "42 params" in capsys.readouterr().out  # 6 x 6 + 6


def test_a_target_that_reads_as_a_path_gets_both_forms(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "g3/llamas.py:llama8b", "--world", "2"]) == 2
    assert capsys.readouterr().err == (
        "shardwise plan: error: cannot import 'g3/llamas.py': no file g3/llamas.py. MODULE is a "
        "dotted module name (g3.llamas:llama8b, importable from the current directory) or the "
        "path of a .py file (g3/llamas.py:llama8b)\n"
    )
    assert main(["plan", "g3/llamas:llama8b", "--world", "2"]) == 2
    assert capsys.readouterr().err == (
        "shardwise plan: error: cannot import 'g3/llamas': No module named 'g3/llamas'. MODULE "
        "is a dotted module name (g3.llamas:llama8b, importable from the current directory) or "
        "the path of a .py file (g3/llamas.py:llama8b)\n"
    )
    assert main(["plan", "nosuchpkg.models:build", "--world", "2"]) == 2
    assert capsys.readouterr().err == (  # a dotted name gets no hint about paths
        "shardwise plan: error: cannot import 'nosuchpkg.models': No module named 'nosuchpkg'\n"
    )
