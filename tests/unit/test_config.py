"""Config loading: recipes + overrides merge onto the schema; bad input names the key."""

from __future__ import annotations

import pytest

from raytrain_dt.cli import main
from raytrain_dt.config import from_yaml, load_config, to_yaml
from raytrain_dt.errors import ConfigError


def test_recipe_and_overrides_merge():
    cfg = load_config("conf/tiny.yaml", ["trainer.steps=30", "run.dir=/tmp/r1"])
    assert cfg.trainer.steps == 30
    assert cfg.run.dir == "/tmp/r1"
    assert cfg.model.preset == "tiny"
    assert from_yaml(to_yaml(cfg)) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.stepz=3", "trainer.stepz: unknown key"),
        ("bogus.key=1", "bogus: unknown key"),
        ("trainer.steps=abc", "trainer.steps: 'abc' is not a valid int"),
        ("resume=maybe", "resume: 'maybe' is not a valid bool"),
        ("trainer.steps=0", "trainer.steps: must be > 0, got 0"),
        ("trainer.lr=-1", "trainer.lr: must be >= 0, got -1.0"),
        ("engine.name=megatron", "engine.name: 'megatron' is not one of fsdp2, deepspeed"),
        (
            "parallel.pp_schedule=zb",
            "parallel.pp_schedule: 'zb' is not one of gpipe, 1f1b, interleaved",
        ),
        ("trainer.min_lr_ratio=2", "trainer.min_lr_ratio: must be in [0, 1], got 2.0"),
        ("trainer.batch_tolerance=1", "trainer.batch_tolerance: must be in [0, 1), got 1.0"),
        ("trainer.warmup_steps=99", "trainer.warmup_steps: 99 exceeds trainer.steps=30"),
        ("data.seq_len=1", "data.seq_len: must be >= 2, got 1"),
        ("trainerx", "trainerx: override must look like key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config("conf/tiny.yaml", [override])
    assert str(info.value) == message


def test_missing_recipe_names_the_file():
    with pytest.raises(ConfigError, match=r"conf/nope.yaml: recipe file not found"):
        load_config("conf/nope.yaml")


def test_cli_exits_2_with_one_line_before_any_actor_starts(capsys, tmp_path):
    code = main(["train", "conf/tiny.yaml", "trainer.stepz=3", f"run.dir={tmp_path}/r"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["error: trainer.stepz: unknown key"]
    assert not (tmp_path / "r").exists()


def test_cli_missing_dataset_is_one_line(capsys, tmp_path):
    code = main(["train", "conf/tiny.yaml", f"data.path={tmp_path}/none", f"run.dir={tmp_path}/r"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path}/none: dataset path does not exist (data.path)"
    )


def test_kill_rank_mid_save_is_refused_for_an_engine_whose_saves_cannot_be_interrupted():
    chaos = "chaos=[{at_step: 2, action: kill_rank_mid_save, target: 0}]"
    with pytest.raises(ConfigError, match=r"chaos\[0\]\.action: kill_rank_mid_save needs engine"):
        load_config(None, ["engine.name=deepspeed", chaos])
    load_config(None, ["engine.name=fsdp2", chaos])


def test_chaos_at_is_step_forming_or_joined_and_those_fire_only_kills():
    with pytest.raises(
        ConfigError, match=r"^chaos\[1\]\.at: 'setup' is not one of step, forming, joined$"
    ):
        load_config(None, ["chaos=[{at_step: 2}, {at_step: 3, action: kill_node, at: setup}]"])
    with pytest.raises(ConfigError, match=r"^chaos\[0\]\.at: joined fires only kill_rank, not"):
        load_config(None, ["chaos=[{at_step: 2, action: kill_node, at: joined}]"])
    assert load_config(None, ["chaos=[{at_step: 2, at: joined}]"]).chaos[0].at == "joined"
    with pytest.raises(
        ConfigError, match=r"^chaos\[0\]\.at: forming fires only kill_node or kill_rank, not hang"
    ):
        load_config(None, ["chaos=[{at_step: 2, action: hang_rank, at: forming}]"])
    for action in ("kill_node", "kill_rank"):
        cfg = load_config(None, [f"chaos=[{{at_step: 2, action: {action}, at: forming}}]"])
        assert cfg.chaos[0].at == "forming"


def test_a_rank_fault_of_a_formation_is_carried_once_and_only_once_due():
    """A `kill_rank` `at: forming` reaches the ranks only in the first formation once the run
    has begun its step (not before, not again), and a failure at that step does not spend it."""
    from raytrain_dt.control.node_chaos import Chaos

    cfg = load_config(
        None,
        [
            "chaos=[{at_step: 6, action: kill_rank, target: 1},"
            " {at_step: 6, action: kill_rank, target: 2, at: forming},"
            " {at_step: 9, action: kill_node, target: 0, at: forming}]"
        ],
    )
    chaos = Chaos(cfg.chaos, simulated=None)
    assert chaos.for_formation(0) == [cfg.chaos[0], cfg.chaos[2]]  # the first formation
    chaos.mark_rank_faults_fired(6)  # rank 1 died at step 6
    assert chaos.for_formation(6) == [cfg.chaos[1], cfg.chaos[2]]
    assert chaos.for_formation(6) == [cfg.chaos[2]]  # spent with the formation it was due in
