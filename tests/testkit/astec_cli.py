"""The `astec` CLI in a subprocess, as a user runs it."""

from testkit.paths import REPO


def astec(*args: str, timeout: float = 600) -> str:
    """Run the `astec` CLI in a subprocess (as a user would); returns stdout, raises on failure."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "infra.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"astec {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}"
        )
    return res.stdout
