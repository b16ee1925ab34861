"""A survivor that cannot save the step a peer was lost in names the checkpoint the restart resumes from:
the newest on disk, not a background write's still under way (training/emergency.py _refuse)."""

import pytest

from test_emergency_save import lose_peer_in, trainer
from trimtab.training import emergency

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_peer_lost_while_a_background_save_is_written_names_the_newest_finished_checkpoint(
    tmp_path, monkeypatch, capfd
):
    """2 ranks, checkpoint.every=5 asynchronous, kill_rank@21:1: step 20's background write was under way (its
    collectives wait on the lost peer: it left a .tmp_ directory), and the survivor said "the restart resumes
    from the last checkpoint, step 20", the write's step from its start. Here step 3's write, held unfinished:
    the newest finished checkpoint, step 0, is named."""
    monkeypatch.setattr(emergency, "RANK_0_FIRST_S", 0.0)
    hit = trainer(tmp_path / "async", 3, "train.max_steps=5", "checkpoint.asynchronous=true")
    lose_peer_in(hit, 4, monkeypatch)
    monkeypatch.setattr(hit.dist, "writing_in_background", lambda: hit.state.step == 3)  # step 3's, not done
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        hit.fit()
    (said,) = [line for line in capfd.readouterr().err.splitlines() if "no emergency save" in line]
    assert said.endswith(
        "the restart resumes from the last finished checkpoint, step 0 (step 3's, written in the background, is not)"
    )


def test_a_survivor_whose_torchrun_has_no_restart_left_says_the_same_command_resumes(monkeypatch):
    """torchrun's workers know their restart count and bound: where they are spent, torchrun restarts nothing
    (a survivor said it would: 'Two kills with --max-restarts 1')."""
    from trimtab.training.emergency import next_words

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert next_words("step 8").startswith("torchrun restarts the job from step 8 (--max-restarts)")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert next_words("step 8").startswith("torchrun restarts the job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert next_words("step 8") == (
        "torchrun has no restart left (--max-restarts 1, all used): the same command resumes from step 8"
    )
