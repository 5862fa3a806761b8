"""AstecConfig: per-module sections, the flat shape models were saved in before them, and the CLI
options whose defaults and help come from the sections."""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from engine.astec.config import (
    FLAT_NAMES,
    SECTIONS,
    AstecConfig,
    ConfigError,
    EnsembleParams,
    TrainingParams,
)
from testkit.paths import TESTS_DATA

FLAT_FILE = Path(TESTS_DATA, "engine", "model_config_flat.json")


def flat_dict(cfg: AstecConfig) -> dict:
    """cfg in the single-class shape (what the code before the sections wrote)."""
    out = {
        name: list(v) if isinstance(v := getattr(getattr(cfg, s), f), tuple) else v
        for name, (s, f) in FLAT_NAMES.items()
    }
    return {**out, "seed": cfg.seed}


def test_every_field_has_one_flat_name():
    fields = [(s, f.name) for s, c in SECTIONS.items() for f in dataclasses.fields(c)]
    assert sorted(FLAT_NAMES.values()) == sorted(fields)
    # the file the single-class code wrote names exactly these fields, but those added since
    # (loading it gives them their defaults)
    added_since = {
        "exact_max_centres",
        "surrogate_patience",
        "surrogate_large_fraction",
        "surrogate_large_from",
        "sparse_refit_iters",
        "precision",
        "surrogate_sampled_from",
        "surrogate_sampled_block",
        "surrogate_sampled_negatives",
    }
    assert set(json.loads(FLAT_FILE.read_text())) == (set(FLAT_NAMES) - added_since) | {"seed"}


def test_config_written_by_the_flat_class_loads():
    cfg = AstecConfig.load(FLAT_FILE)
    assert cfg.seed == 7 and cfg.ensembles.learners == 2 and cfg.training.threads == 1
    assert cfg.network.embedding_dim == 32 and cfg.surrogate.epochs == 3
    assert cfg.shortlist.negatives == 40 and cfg.search.candidates == 40
    assert cfg.surrogate.num_clusters == 8 and cfg.shortlist.hnsw_x == (50, 100, 100)
    nested = cfg.to_dict()
    assert set(nested) == set(SECTIONS) | {"seed"}
    assert nested["training"]["threads"] == 1 and nested["shortlist"]["hnsw_x"] == [50, 100, 100]
    assert AstecConfig.from_dict(nested) == cfg
    assert AstecConfig.from_dict(flat_dict(cfg)) == cfg


def test_flat_names_only_load_and_a_misspelt_field_is_an_error():
    """The flat names read old config files (`from_dict`); a config is built and used by its
    sections only, and a field it does not have is refused, not silently added."""
    a = AstecConfig.from_dict({"num_threads": 1, "reranker": False, "ensemble": "max"})
    b = AstecConfig(training=TrainingParams(threads=1), ensembles=EnsembleParams(join="max"))
    b.rerank.enabled = False
    assert a == b
    with pytest.raises(TypeError, match="num_threads"):
        AstecConfig(num_threads=1)  # type: ignore[call-arg]
    with pytest.raises(AttributeError, match="num_threads"):
        _ = a.num_threads  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="num_thread"):
        a.num_thread = 2  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="training"):
        AstecConfig(training={"threads": 1})  # type: ignore[arg-type]
    given = TrainingParams(threads=2)
    c = AstecConfig(training=given)
    given.threads = 3  # the config holds its own copy
    assert c.training.threads == 2


def test_copies_and_resolve_leave_the_original_alone():
    c = AstecConfig()
    r = c.resolve(3)
    assert r.surrogate.num_clusters <= 3 and r.training.threads >= 1
    assert c.training.threads == 0 and c.surrogate.num_clusters == 0
    d = c.copy()
    d.search.candidates = 7
    assert c.search.candidates == 300


def test_json_errors_name_the_file_and_field(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"training": {"threads": "all"}}))
    with pytest.raises(ConfigError, match=r"c\.json.*training\.threads.*number"):
        AstecConfig.load(p)
    p.write_text(json.dumps({"training": {"thread": 1}}))
    with pytest.raises(ConfigError, match=r"training\.thread\b"):
        AstecConfig.load(p)
    p.write_text(json.dumps({"training": {"threads": 1}, "num_threads": 2}))
    with pytest.raises(ConfigError, match=r"num_threads.*training\.threads"):
        AstecConfig.load(p)
    p.write_text(json.dumps({"training": {"device": "tpu"}}))
    with pytest.raises(ConfigError, match=r"c\.json.*training\.device"):
        AstecConfig.load(p)
    p.write_text('{"seed": 1,\n "training": }')
    with pytest.raises(ConfigError, match=r"c\.json:2"):
        AstecConfig.load(p)


@pytest.mark.slow
def test_model_dir_with_a_flat_config_loads_and_predicts_the_same(tmp_path):
    """A model directory written before the sections (flat config.json) loads with this code and
    predicts what it predicted; a model saved now writes the nested shape."""
    from engine.astec import Astec
    from engine.astec import io as mio
    from engine.synthetic import zipf_dataset

    texts, Y = zipf_dataset(500, 30, labels_per_point=2, words_per_point=4, vocab_size=150, seed=1)
    cfg = AstecConfig.from_dict(
        {
            "embedding_dim": 16,
            "surrogate_epochs": 2,
            "extreme_epochs": 2,
            "reranker_epochs": 1,
            "batch_size": 64,
            "num_threads": 1,
            "knn_neighbours": 5,
            "centroid_neighbours": 10,
        }
    )
    model = Astec.train(texts[:400], Y[:400], cfg, progress=False)
    root = model.save(tmp_path / "m")
    saved = json.loads((root / "config.json").read_text())
    assert set(saved) == set(SECTIONS) | {"seed"}
    want = model.predict(texts[400:], k=5)

    (root / "config.json").write_text(json.dumps(flat_dict(model.config), indent=2))
    man = json.loads((root / mio.MANIFEST).read_text())
    mio.write_model_manifest(
        root, {k: v for k, v in man.items() if k not in ("format", "format_version", "files")}
    )
    old = Astec.load(root)
    assert old.config == model.config
    got = old.predict(texts[400:], k=5)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_cli_defaults_come_from_the_classes():
    from engine.cli_export import export
    from engine.cli_options import default_of
    from engine.cli_retrain import retrain
    from engine.cli_train import train
    from engine.export import ExportOptions
    from engine.retrain import RetrainSettings

    for cmd, cls in ((export, ExportOptions), (retrain, RetrainSettings)):
        names = {f.name for f in dataclasses.fields(cls)}
        opts = [p for p in cmd.params if p.name in names and not getattr(p, "is_flag", False)]
        assert opts
        for p in opts:
            assert p.default == default_of(cls, p.name), (cmd.name, p.name)
    helps = {p.name: p.help for p in train.params}
    for name, cls in (("threads", TrainingParams), ("device", TrainingParams)):
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        assert field.metadata["help"] in helps[name]
        assert f"else {field.default!r}" in helps[name]
    r = CliRunner().invoke(train, ["--help"])
    assert "else 0" in r.output and "every core" in r.output


@pytest.mark.slow
def test_train_threads_is_a_config_field_not_an_environment_change(tmp_path):
    from engine.formats import write_text_tsv
    from engine.synthetic import zipf_dataset
    from infra.cli import cli

    texts, Y = zipf_dataset(300, 20, labels_per_point=2, words_per_point=3, vocab_size=100, seed=4)
    write_text_tsv(tmp_path / "train.tsv", texts, Y)
    (tmp_path / "cfg.json").write_text(
        json.dumps(
            {
                "network": {"embedding_dim": 16},
                "surrogate": {"epochs": 1},
                "extreme": {"epochs": 1},
                "rerank": {"enabled": False},
                "sparse": {"enabled": False},
            }
        )
    )
    env_before = dict(os.environ)
    r = CliRunner().invoke(
        cli,
        [
            "train",
            "--train",
            str(tmp_path / "train.tsv"),
            "--out",
            str(tmp_path / "m"),
            "--config",
            str(tmp_path / "cfg.json"),
            "--threads",
            "1",
            "--precision",
            "float32",
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["training"]["threads"] == 1 and saved["network"]["embedding_dim"] == 16
    assert saved["training"]["precision"] == "float32"
    assert dict(os.environ) == env_before


def test_meta_label_count_follows_label_count():
    """Module I's meta-labels: 0.1 L up to 1,024, then 0.05 L (the paper's lower bound), as a
    power of two, at most 2^16 and L; an explicit num_clusters wins."""
    auto = {L: AstecConfig().resolve(L).surrogate.num_clusters for L in (3, 580, 13_728, 25_918)}
    assert auto == {3: 1, 580: 64, 13_728: 1024, 25_918: 1024}
    assert AstecConfig().resolve(500_000).surrogate.num_clusters == 32_768
    assert AstecConfig().resolve(3_000_000).surrogate.num_clusters == 65_536
    cfg = AstecConfig()
    cfg.surrogate.num_clusters = 2048
    assert cfg.resolve(25_918).surrogate.num_clusters == 2048
