"""Model registry: atomic promotion, keep-last-N, and crashes that must not move CURRENT."""

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from engine.registry import Registry, RegistryError


def _make(reg: Registry, payload: str) -> str:
    st = reg.stage()
    (st.path / "predictor").mkdir()
    (st.path / "predictor" / "weights.txt").write_text(payload)
    reg.commit(st, {"metrics": {"P@1": 0.5}})
    return st.version


def test_promote_switches_pointer_and_prune_keeps_last_n(tmp_path):
    reg = Registry(tmp_path / "models", keep=2)
    assert reg.current() is None
    ids = [_make(reg, f"w{i}") for i in range(4)]
    assert ids == sorted(ids) and len(set(ids)) == 4
    reg.promote(ids[1])
    assert json.loads((tmp_path / "models" / "CURRENT").read_text())["version"] == ids[1]
    assert (reg.current_path() / "predictor" / "weights.txt").read_text() == "w1"
    removed = reg.prune()
    # the two newest stay, and the current one (older) is never deleted
    assert removed == [ids[0]]
    assert reg.versions() == [ids[1], ids[2], ids[3]]
    reg.promote(ids[3])
    assert reg.prune() == [ids[1]]
    assert reg.current() == ids[3]
    assert reg.meta(ids[3])["metrics"] == {"P@1": 0.5}


def test_staging_is_never_listed_or_promotable(tmp_path):
    reg = Registry(tmp_path)
    st = reg.stage()
    (st.path / "half.bin").write_bytes(b"\0" * 10)
    assert reg.versions() == []
    with pytest.raises(RegistryError, match="not a complete version"):
        reg.promote(st.version)
    assert reg.cleanup_staging() == [st.path.name]
    assert not st.path.exists()


def test_corrupt_pointer_is_reported_with_its_path(tmp_path):
    reg = Registry(tmp_path)
    (tmp_path / "CURRENT").write_text("{not json")
    with pytest.raises(RegistryError, match="CURRENT"):
        reg.current()
    (tmp_path / "CURRENT").write_text(json.dumps({"version": "nope"}))
    with pytest.raises(RegistryError, match="not a complete version"):
        reg.current()


def test_writer_killed_mid_version_leaves_current_untouched(tmp_path):
    reg = Registry(tmp_path, keep=3)
    good = _make(reg, "good")
    reg.promote(good)
    before = (tmp_path / "CURRENT").read_bytes()
    # A child process stages a version, writes half of it and dies hard before committing.
    code = textwrap.dedent(f"""
        import os
        from engine.registry import Registry
        reg = Registry({str(tmp_path)!r})
        with reg.lock():
            st = reg.stage()
            (st.path / "predictor").mkdir()
            (st.path / "predictor" / "w.bin").write_bytes(b"x" * 1000)
            os._exit(137)
    """)
    rc = subprocess.run([sys.executable, "-c", code], check=False, cwd=os.getcwd()).returncode
    assert rc == 137
    assert (tmp_path / "CURRENT").read_bytes() == before
    assert reg.current() == good and reg.versions() == [good]
    # the lock died with the process; the next writer cleans the leftovers
    with reg.lock(wait=False):
        assert len(reg.cleanup_staging()) == 1


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_registry_files_are_private_under_any_umask(tmp_path, umask):
    """Registry files 0600 and directories 0700, whatever the umask, the model files written
    into a staged version by other code included (commit makes the tree private)."""
    old = os.umask(umask)
    try:
        reg = Registry(tmp_path / "models")
        with reg.lock():
            v = _make(reg, "w")
            reg.promote(v)
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    root = tmp_path / "models"
    for d in (root, root / "versions", root / "versions" / v, root / "versions" / v / "predictor"):
        assert mode(d) == 0o700, d
    for f in (
        root / "CURRENT",
        root / ".lock",
        root / "versions" / v / "version.json",
        root / "versions" / v / "predictor" / "weights.txt",
    ):
        assert mode(f) == 0o600, f
    assert reg.current() == v


def test_current_pointer_may_only_name_a_version_under_versions(tmp_path):
    reg = Registry(tmp_path / "models")
    good = _make(reg, "good")
    # a complete-looking version outside versions/ must not be reachable through CURRENT
    outside = tmp_path / "models" / "x"
    outside.mkdir()
    (outside / "version.json").write_text("{}")
    for bad in ["../x", str(outside), "/etc", ".staging-" + good, "..", "", 7, None, ["a"]]:
        (tmp_path / "models" / "CURRENT").write_text(json.dumps({"version": bad}))
        with pytest.raises(RegistryError, match=r"models/CURRENT: version .* refusing it"):
            reg.current()
    (tmp_path / "models" / "CURRENT").write_text(json.dumps({"version": "20200101T000000Z-ab"}))
    with pytest.raises(RegistryError, match=r"models/CURRENT: points at .* not a complete"):
        reg.current()
    with pytest.raises(RegistryError, match="refusing it"):
        reg.promote("../x")
    with pytest.raises(RegistryError, match="refusing it"):
        reg.meta("../x")
    reg.promote(good)
    assert reg.current() == good


def test_update_meta_is_gone():
    assert not hasattr(Registry, "update_meta")
