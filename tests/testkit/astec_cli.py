"""The `astec` CLI in a subprocess, as a user runs it."""

from testkit.paths import REPO


def astec(*args: str, timeout: float = 600, cwd=REPO) -> str:
    """Run the `astec` CLI in a subprocess (as a user would), in `cwd` (relative paths in args
    resolve there); returns stdout, raises on failure."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(
        [sys.executable, "-m", "infra.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"astec {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}"
        )
    return res.stdout
