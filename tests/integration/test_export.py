"""``hetd export``: the model out of a running daemon, read back by JAX's own libraries alone.

A real daemon trains with a real worker; the worker is stopped (the version stays put); the real
``hetd export --out DIR`` command asks the daemon to export; a fresh Python process that imports
only jax, flax, orbax and numpy restores the orbax ``params`` item alone, the ``meta`` item and the
bare ``params.msgpack``, applies the params with its own flax module, and the params must be
bit-identical to the daemon's. ``model.json`` describes them, and README's example, run as written,
builds its module from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetd.local.procs import stop_processes
from tests.conftest import Cluster
from tests.integration.test_admin import hetd_cli

pytestmark = pytest.mark.slow

# What a user writes: nothing of hetd's. The module mirrors `mlp` with one hidden layer of 32.
READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax.numpy as jnp
    import flax.linen as nn
    import orbax.checkpoint as ocp
    from flax import serialization, traverse_util

    out, dump = sys.argv[1], sys.argv[2]
    manager = ocp.CheckpointManager(out)
    step = manager.latest_step()
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    opt = manager.restore(step, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore()))
    with open(f"{out}/params.msgpack", "rb") as f:
        bare = serialization.msgpack_restore(f.read())

    class MyMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
            return nn.Dense(10)(x)

    logits = MyMLP().apply({"params": bare}, jnp.zeros((2, 64)))
    flat = lambda tree: {
        "/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()
    }
    np.savez(dump, **{"orbax:" + k: v for k, v in flat(restored.params).items()},
             **{"msgpack:" + k: v for k, v in flat(bare).items()})
    hetd = sorted(m for m in sys.modules if m.split(".")[0] in ("hetd", "workers", "policies"))
    print(json.dumps({"step": step, "steps": manager.all_steps(), "meta": meta,
                      "logits_shape": list(logits.shape), "hetd_modules": hetd,
                      "opt_leaves": len(traverse_util.flatten_dict(opt.opt_state))
                                    if opt.opt_state else 0}))
    """
)


async def test_export_round_trips_bit_identical_through_orbax_and_msgpack(
    cluster: Any, tmp_path: Path
) -> None:
    c: Cluster = await cluster(
        "asp",
        model_kwargs={"hidden": [32]},
        optimizer="momentum",
        store={"export_dir": str(tmp_path / "exports")},
    )
    await c.spawn(1.0, 0.01)
    await c.wait_for(lambda: c.engine.store.version >= 5, 120, "5 applied updates")
    await stop_processes(c.procs)
    await c.wait_for(lambda: not c.engine.members.facts, 30, "the worker to leave")
    snap = c.engine.store.snapshot()

    out = tmp_path / "exports" / "model"  # --out names a directory under the export root
    code, stdout, err = await hetd_cli("export", "--out", "model", "--admin-url", c.admin_url)
    assert code == 0, err
    assert f"exported version {snap.version} to {out}" in stdout, stdout
    # again at the same version: the step is kept, not written twice
    code, stdout, err = await hetd_cli("export", "--out", "model", "--admin-url", c.admin_url)
    assert code == 0 and "already there" in stdout, (stdout, err)
    # a path it cannot write: a clear refusal, and the daemon carries on
    (tmp_path / "exports" / "file").write_text("not a directory")
    code, _, err = await hetd_cli("export", "--out", "file/x", "--admin-url", c.admin_url)
    assert code == 1 and "bad_out" in err and "'file' is not a directory" in err, err
    assert c.daemon._engine_task is not None and not c.daemon._engine_task.done()

    dump = tmp_path / "restored.npz"
    proc = subprocess.run(
        [sys.executable, "-c", READER, str(out), str(dump)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["hetd_modules"] == [], "the reader needed hetd"
    assert report["step"] == snap.version and report["steps"] == [snap.version]
    assert report["logits_shape"] == [2, 10]
    assert report["opt_leaves"] > 0  # momentum has a trace per parameter
    meta = report["meta"]
    assert meta["version"] == snap.version
    assert meta["policy"]["name"] == "asp"
    assert meta["model"] == {"spec": "mlp", "kwargs": {"hidden": [32]}}
    assert meta["dataset"]["spec"] == "digits"
    assert meta["samples_seen"] > 0
    assert "admin_token" not in json.dumps(meta) and "worker_token" not in json.dumps(meta)

    # model.json says what params.msgpack holds, in plain JSON.
    described = json.loads((out / "model.json").read_text())
    assert described["format"] == "hetd-export-model" and described["version"] == snap.version
    assert described["model"] == {"spec": "mlp", "kwargs": {"hidden": [32]}}
    assert described["dataset"]["spec"] == "digits"
    assert described["params"] == {
        name: {"shape": list(np.shape(v)), "dtype": "float32"} for name, v in snap.tensors.items()
    }
    assert described["n_params"] == sum(int(np.size(v)) for v in snap.tensors.values())
    # README's example, as written (DIR replaced), reads it into its own module.
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Taking the model out", 1)[1].split("\n### ", 1)[0]
    example = section.split("```python\n", 1)[1].split("```", 1)[0].replace("DIR", str(out))
    proc = subprocess.run(
        [sys.executable, "-c", example + "\nprint(tuple(logits.shape))"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "(1, 10)", proc.stdout

    restored = np.load(dump)
    for source in ("orbax", "msgpack"):
        got = {k.split(":", 1)[1]: restored[k] for k in restored.files if k.startswith(source)}
        assert set(got) == set(snap.tensors), source
        for name, value in snap.tensors.items():
            mine = np.asarray(value)
            assert got[name].dtype == mine.dtype and got[name].shape == mine.shape, name
            # bit for bit: compare the raw bytes, not float equality
            assert got[name].tobytes() == mine.tobytes(), (source, name)
