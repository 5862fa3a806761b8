"""`astec data build`: the debian-related data set from an `apt-cache dumpavail` catalogue."""

import shutil

import pytest
from click.testing import CliRunner

from engine.debian_packages import CatalogueError, build, packages
from engine.formats import read_label_names, read_text_tsv

CATALOGUE = """\
Package: editor-a
Version: 1.0
Depends: libc6 (>= 2.34), libncurses6:any (>= 6), python3 | python3-minimal
Recommends: spell-data [amd64]
Description: small text editor for the console
 A longer description that is not the point's text.

Package: editor-a
Version: 0.9
Depends: something-old
Description: an older version listed second

Package: editor-b
Pre-Depends: libc6
Suggests: spell-data, python3
Description: graphical   text editor

Package: lonely
Depends: nothing-else-names-this
Description: a package whose only relation is named once

Package: no-description
Depends: libc6
"""


def test_relations_become_labels_with_versions_and_qualifiers_stripped():
    rows = {name: (desc, rel) for name, desc, rel in packages(CATALOGUE)}
    assert set(rows) == {"editor-a", "editor-b", "lonely"}  # no description: not a point
    desc, rel = rows["editor-a"]
    assert desc == "small text editor for the console"  # the first line only; first version wins
    assert rel == ["libc6", "libncurses6", "python3", "python3-minimal", "spell-data"]


def test_rare_labels_and_unlabelled_points_are_dropped():
    ds = build(packages(CATALOGUE), test_share=0.0)
    # named by one package only: libncurses6, python3-minimal, nothing-else-names-this
    assert ds.label_names == ["libc6", "python3", "spell-data"]
    assert ds.train_texts == ["small text editor for the console", "graphical text editor"]
    assert ds.dropped_no_label == 1 and not ds.test_texts


def test_ubiquitous_labels_can_be_dropped():
    more = CATALOGUE + "\nPackage: third\nDepends: libc6, python3\nDescription: a third\n"
    ds = build(packages(more), test_share=0.0, max_label_share=0.5)
    assert ds.label_names == ["spell-data"]  # libc6 and python3: 3 of 4 packages name them


def test_the_split_is_by_package_name_and_stable_under_sampling():
    big = "\n".join(
        f"Package: p{i}\nDepends: libc6, lib{i % 7}\nDescription: tool number {i}\n"
        for i in range(400)
    )
    a, b = build(packages(big)), build(packages(big))
    assert a.train_texts == b.train_texts and 0.2 < len(a.test_texts) / 400 < 0.4
    sample = build(packages(big), max_points=200)
    assert len(sample.train_texts) + len(sample.test_texts) == 200
    assert set(sample.test_texts) <= set(a.test_texts)  # a package keeps its side


def test_a_stanza_without_package_names_its_line():
    with pytest.raises(CatalogueError, match=r"cat:8: a stanza without a Package field"):
        list(
            packages(
                "Package: a\nDescription: x\nDepends: b\n\nPackage: b\nDescription: y\n\n"
                "Version: 1\nDescription: orphan\n",
                "cat",
            )
        )


def test_cli_builds_readable_files(tmp_path):
    from engine.cli_data import data

    src = tmp_path / "dumpavail.txt"
    src.write_text(
        CATALOGUE * 1
        + "\n"
        + "\n".join(
            f"Package: q{i}\nDepends: libc6, python3\nDescription: helper {i}\n" for i in range(60)
        )
    )
    out = tmp_path / "ds"
    res = CliRunner().invoke(data, ["build", "--out", str(out), "--from", str(src)])
    assert res.exit_code == 0, res.output
    names = read_label_names(out / "labels.txt")
    texts, Y = read_text_tsv(out / "train.tsv", num_labels=len(names))
    assert names[:2] == ["libc6", "python3"] and Y.shape == (len(texts), len(names))
    assert "labels" in res.output and (out / "stats.json").exists()


@pytest.mark.skipif(shutil.which("apt-cache") is None, reason="not a Debian-family machine")
def test_this_machines_catalogue_builds_a_sample(tmp_path):
    from engine.cli_data import data

    res = CliRunner().invoke(data, ["build", "--out", str(tmp_path), "--max-points", "2000"])
    assert res.exit_code == 0, res.output
    names = read_label_names(tmp_path / "labels.txt")
    texts, Y = read_text_tsv(tmp_path / "train.tsv", num_labels=len(names))
    assert len(texts) > 500 and Y.nnz > len(texts)  # real text, several related packages each
