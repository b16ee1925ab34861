"""Under torchrun every rank reads the same config, so a config refusal was printed once per rank (twice with
--nproc-per-node 2); each machine's first rank (LOCAL_RANK 0) says it, and every rank exits 2."""

import pytest

from trimtab.cli import main


@pytest.mark.parametrize("rank, said", [("0", True), ("1", False)])
def test_a_config_refusal_is_said_once_a_machine(rank, said, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LOCAL_RANK", rank)
    code = main(["train", "--preset", "debug", "--set", "train.nope=1", "--out", str(tmp_path / "run")])
    assert code == 2
    assert ("unknown config key 'train.nope'" in capsys.readouterr().err) is said
