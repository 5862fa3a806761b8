"""`astec personalize` and the closed loop take their engine as every command does
(engine.model_paths.resolve_model): a registry, a version or an exported predictor; a trained
model that was never exported, or anything else, is one line naming what it got and what to do."""

import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from engine.registry import Registry
from personalization.cli_policy import personalize, resolve_predictor_dir


@pytest.fixture(scope="module")
def registry(astec_predictor, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reg") / "models"
    reg = Registry(root)
    st = reg.stage()
    src = Path(astec_predictor).parent
    shutil.copytree(src / "model", st.path / "model")
    shutil.copytree(src / "predictor", st.path / "predictor")
    reg.commit(st)
    reg.promote(st.version)
    return root


def test_registry_version_and_predictor_resolve_to_the_predictor(registry, astec_predictor):
    vdir = registry / "versions" / str(Registry(registry).current())
    assert resolve_predictor_dir(registry) == vdir / "predictor"
    assert resolve_predictor_dir(vdir) == vdir / "predictor"
    assert resolve_predictor_dir(Path(astec_predictor)) == Path(astec_predictor)


def test_a_trained_model_says_to_export_it(astec_predictor):
    model = Path(astec_predictor).parent / "model"
    with pytest.raises(click.UsageError, match=r"a trained model, not an exported predictor.*"):
        resolve_predictor_dir(model)
    with pytest.raises(click.UsageError, match="astec export --model"):
        resolve_predictor_dir(model)


def test_the_cli_error_is_one_line_naming_the_path(astec_predictor, tmp_path):
    (tmp_path / "logs").mkdir()
    for bad, want in (
        (Path(astec_predictor).parent / "model", "astec export"),
        (tmp_path / "logs", "not a model (no CURRENT, version.json or manifest.json"),
    ):
        res = CliRunner().invoke(
            personalize, ["train", "--logs", str(tmp_path / "logs"), "--models", str(bad)]
        )
        assert res.exit_code == 2, res.output
        err = [x for x in res.output.splitlines() if x.startswith("Error")]
        assert len(err) == 1 and str(bad) in err[0] and want in err[0], res.output
        assert "Traceback" not in res.output
