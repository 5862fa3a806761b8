"""private_dir: the one way the registry, the click log and the local services make the
directories that hold tokens, passwords and clicks."""

import os
import stat

from engine.private_dirs import private_dir


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_made_0700_whatever_the_umask_and_existing_ones_tightened(tmp_path):
    old = os.umask(0o077 ^ 0o777)  # a umask that would leave new directories wide open
    try:
        d = private_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert d == tmp_path / "a" / "b" and mode(d) == 0o700
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    assert mode(private_dir(tmp_path / "open")) == 0o700


def test_below_top_every_level_is_private_and_an_existing_top_is_left_alone(tmp_path):
    top = tmp_path / "log"
    top.mkdir()
    os.chmod(top, 0o750)  # the operator's own choice
    private_dir(top / "clicks" / "2026-12-05", top)
    assert mode(top) == 0o750
    assert mode(top / "clicks") == 0o700 and mode(top / "clicks" / "2026-12-05") == 0o700
    fresh = tmp_path / "new-log"
    private_dir(fresh / "views", fresh)
    assert mode(fresh) == 0o700 and mode(fresh / "views") == 0o700
