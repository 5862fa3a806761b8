"""`astec personalize train` takes every training default from TrainConfig (one home per
default): an option's default is the field's, whatever value the field is given."""

import dataclasses

from personalization.cli_policy import personalize
from personalization.train_config import TrainConfig

# option name -> TrainConfig field, where they differ
RENAMED = {"horizon": "future_horizon", "seeds": "seed"}
NOT_TRAINING = {"logs", "models", "out", "promote", "keep", "quiet"}


def test_every_train_option_defaults_to_its_train_config_field():
    cmd = personalize.commands["train"]
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    checked = set()
    for p in cmd.params:
        if p.name in NOT_TRAINING:
            continue
        field = RENAMED.get(p.name, p.name)
        assert field in fields, f"--{p.name} feeds no TrainConfig field"
        want = (fields[field],) if p.multiple else fields[field]
        assert p.default == want, (p.name, p.default, want)
        checked.add(field)
    assert len(checked) >= 18


def test_cli_listing_does_not_load_torch():
    import subprocess
    import sys

    from testkit.paths import REPO

    code = "import sys, personalization.cli_policy; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO).returncode == 0


def test_an_incumbent_of_other_label_ids_is_not_compared():
    """`astec personalize train` judges a new version against the current policy only when
    both read the same engine ids (the fingerprint; the engine version for an older policy)."""
    from types import SimpleNamespace

    from personalization.cli_policy import same_engine

    v = SimpleNamespace(label_space="a" * 64, engine_version="e2")
    assert same_engine({"engine_label_space": "a" * 64, "engine_version": "e1"}, v)
    assert not same_engine({"engine_label_space": "b" * 64, "engine_version": "e2"}, v)
    assert same_engine({"engine_version": "e2"}, v)  # recorded no fingerprint: same version
    assert not same_engine({"engine_version": "e1"}, v) and not same_engine({}, v)
