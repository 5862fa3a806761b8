"""Every command's --model takes what the user holds: a registry, a version, a trained model
or an exported predictor; anything else is one line that says what to give."""

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.model_paths import ModelPathError, resolve_model
from engine.registry import Registry


@pytest.fixture(scope="module")
def registry(astec_predictor, tmp_path_factory) -> Path:
    """A registry whose promoted version holds the fixture's model and predictor."""
    root = tmp_path_factory.mktemp("reg") / "models"
    reg = Registry(root)
    st = reg.stage()
    src = Path(astec_predictor).parent
    shutil.copytree(src / "model", st.path / "model")
    shutil.copytree(src / "predictor", st.path / "predictor")
    reg.commit(st)
    reg.promote(st.version)
    return root


def test_each_kind_of_path_resolves(registry, astec_predictor):
    version = Registry(registry).current()
    vdir = registry / "versions" / version
    got = resolve_model(registry)
    assert (got.kind, got.path, got.version) == ("predictor", vdir / "predictor", version)
    assert resolve_model(registry, prefer="model").path == vdir / "model"
    assert resolve_model(vdir).version == version
    assert resolve_model(Path(astec_predictor).parent / "model").kind == "model"
    assert resolve_model(astec_predictor).kind == "predictor"


def test_anything_else_says_what_to_give(tmp_path):
    with pytest.raises(
        ModelPathError,
        match=r"not a model \(no CURRENT, version.json or manifest.json in it\); "
        r"give a model registry .* predictor",
    ):
        resolve_model(tmp_path)
    with pytest.raises(ModelPathError, match="no such directory"):
        resolve_model(tmp_path / "missing")
    (tmp_path / "CURRENT").write_text("")
    with pytest.raises(ModelPathError):
        resolve_model(tmp_path)  # an empty pointer: refused, not read as a path


def test_predict_takes_a_registry_and_marks_titles_it_knows_nothing_of(registry):
    from engine.cli_train import predict

    res = CliRunner().invoke(
        predict,
        [
            "--model",
            str(registry),
            "--text",
            "openssh server",
            "--text",
            "zzqxv blorfx",
            "--top-k",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    out = res.stdout.split("zzqxv blorfx")
    assert len(out[0].strip().splitlines()) == 4  # the known title: its three queries
    assert out[1].strip() == "no known word: no queries"  # not the prior's ten guesses


def test_the_stream_and_the_dashboard_take_a_registry_version(registry):
    """check_model / ModelHandle.open (astec stream run) and the dashboard's --models load a
    registry version directory, not only a registry or a bare predictor."""
    from dashboard.models import resolve_predictor
    from stream.model_handle import ModelHandle, check_model

    version = Registry(registry).current()
    vdir = registry / "versions" / version
    check_model(vdir)
    handle = ModelHandle.open(vdir)
    assert handle.version == version and handle.watcher is None
    assert handle.predictor.predict(["openssh server"], 3)[0].shape == (1, 3)
    ref = resolve_predictor(vdir)
    assert (ref.path, ref.version, ref.source) == (vdir / "predictor", version, "version")
    assert version in ref.describe() and resolve_predictor(registry).source == "registry"


def test_each_command_says_what_it_got_and_what_it_needs(registry, tmp_path):
    """A trained model where a predictor is served, or a predictor given to `astec export`:
    one line naming what the path holds and the command that makes what is needed."""
    from dashboard.models import ModelsError, resolve_predictor
    from engine.cli_export import export
    from stream.model_handle import check_model

    vdir = registry / "versions" / Registry(registry).current()
    with pytest.raises(ModelPathError, match=r"is a trained model.*, not an exported predictor: "):
        check_model(vdir / "model")
    with pytest.raises(ModelsError, match=r"astec export --model .*model --out DIR"):
        resolve_predictor(vdir / "model")
    res = CliRunner().invoke(export, ["--model", str(vdir / "predictor"), "--out", "P"])
    assert res.exit_code == 1 and "is an exported predictor, not a trained model" in res.output
    res = CliRunner().invoke(
        export, ["--model", str(registry), "--out", str(tmp_path / "p"), "--threads", "1"]
    )
    assert res.exit_code == 0, res.output
    assert f"exporting {vdir / 'model'}" in res.output
