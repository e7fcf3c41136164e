"""How tests run the project's own scripts and the commands it prints, as a user does: the demo
(``python scripts/demo.py ...``), a printed command pasted into a shell."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_demo(*overrides, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_as_printed(command: str) -> subprocess.CompletedProcess:
    """``command`` through a shell, from the repository root (where the demo was started), with a
    PATH that does not hold the environment's bin: as a user pastes it without activating the venv."""
    env = {**os.environ, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
