"""The product apart from the lab: every module the daemon and the worker can load (the server,
the engine, the protocol, the codecs, the zoo, the policies, the worker) imports nothing of the
bench, the simulator, the local demo or matplotlib, even once all of them are loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [
    "hetd/server",
    "hetd/core",
    "hetd/protocol",
    "hetd/codecs",
    "hetd/zoo",
    "workers",
    "policies",
]
LAB = ("hetd.bench", "hetd.sim", "hetd.local", "matplotlib")


def test_the_daemon_and_the_worker_load_no_lab_code() -> None:
    modules = ["hetd.cli.serve", "hetd.cli.main"]
    for room in PRODUCT:
        for path in sorted((ROOT / room).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if rel.name == "__main__":
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            modules.append(".".join(parts))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(k for k in sys.modules if k.startswith({LAB!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(modules) > 60  # the rooms were found
    assert out.stdout.strip() == "[]", f"lab modules loaded by the product: {out.stdout}"
