"""`trimtab eval --tasks NAME` for one of lm-eval's own tasks: its TaskManager indexes only the
folders of lm-eval's tasks that NAME (and its groups' and tags' members) are in, not all of its
~14,000 YAML files (~12 s on 2 CPU cores, most of a tiny model's eval); what it resolves is the same."""

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional [eval] extra")
from lm_eval import tasks as lm_tasks  # noqa: E402

from trimtab.errors import ConfigError  # noqa: E402
from trimtab.evaluation import harness  # noqa: E402

BUILT = []  # the (include_path, include_defaults) of each TaskManager made


@pytest.fixture
def built(monkeypatch):
    """Every TaskManager made, recorded; one over all of lm-eval's tasks refused (it is what is cut)."""
    real = lm_tasks.TaskManager

    def recording(*args, include_path=None, include_defaults=True, **kwargs):
        BUILT.append((include_path, include_defaults))
        if include_defaults:
            raise AssertionError("indexed every task lm-eval has")
        return real(*args, include_path=include_path, include_defaults=include_defaults, **kwargs)

    BUILT.clear()
    monkeypatch.setattr(lm_tasks, "TaskManager", recording)
    return BUILT


def test_an_lm_eval_task_resolves_from_its_own_folder(built):
    manager = harness.task_manager(["arithmetic_1dc", "trimtab_tiny"], None)
    assert {"arithmetic_1dc", "trimtab_tiny"} <= set(manager.all_tasks)
    assert manager.task_index["arithmetic_1dc"].yaml_path.parent.name == "arithmetic"
    assert len(manager.all_tasks) < 1000  # not lm-eval's ~14,700 names
    assert all(not defaults for _, defaults in built)


def test_a_group_and_a_tag_bring_every_member(built):
    """mmlu is a group of groups whose members are tags; ai2_arc a tag: each reaches its tasks."""
    manager = harness.task_manager(["mmlu", "ai2_arc"], None)
    reached, tags = harness._members(manager.task_index, ["mmlu", "ai2_arc"])
    assert {"mmlu_abstract_algebra", "mmlu_world_religions", "arc_easy", "arc_challenge"} <= reached
    assert {"ai2_arc", "mmlu_stem_tasks"} <= tags
    assert all(name in manager.task_index for name in reached)  # none left to be read as an inline task
    assert manager.task_index["ai2_arc"].tags >= {"arc_easy", "arc_challenge"}


def test_a_name_only_mentioned_in_a_yaml_still_gets_the_clear_error(built, monkeypatch):
    """'allenai' is in YAML text (dataset_path: allenai/ai2_arc) but names no task: after the folders
    that mention it, the whole registry is asked (here a stand-in without lm-eval's defaults), and
    the error names the task and how to list tasks."""
    calls = []
    narrow = harness._narrow_manager
    monkeypatch.setattr(harness, "_narrow_manager", lambda *a: calls.append(a) or narrow(*a))
    with pytest.raises(AssertionError, match="indexed every task"):  # the fallback is the whole registry
        harness.task_manager(["allenai"], None)
    assert calls and calls[0][0] == ["allenai"]
    with pytest.raises(ConfigError, match=r"unknown task 'no_such_task_x'.*`lm_eval --tasks list`"):
        harness.task_manager(["no_such_task_x"], None)
