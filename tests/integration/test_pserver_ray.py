"""The Ray backend ([pservers] backend = "ray") on a Ray cluster of fake nodes on this host
(``ray.cluster_utils.Cluster``: a head and two nodes): two pservers as named Ray actors spread over
the nodes of the placement group ``hetd``, two real ``hetd-worker`` processes training through
them, one pserver's process SIGKILLed (Ray restarts its actor) and the node of the other removed
(Ray places its bundle and actor again on a node left). No push is lost or applied twice, both
come back at the address the workers hold, and both slices end with the head's parameters bit for
bit. Ray is the ``ray`` extra, which ``make test`` installs."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hetd import config as config_mod
from hetd.pserver import disk
from hetd.pserver.partition import join
from hetd.server.daemon import Daemon
from tests.conftest import WORKER_TOKEN, make_config, start_worker, until

ray = pytest.importorskip(
    "ray", reason="Ray is not installed: the ray tier needs the extra (pip install -e '.[ray]')"
)

# Ray starts its nodes' processes from this one with a preexec_fn, which runs the fork handlers
# JAX registers once it is imported (by the tests before these in the same process): JAX warns
# that a fork of a multithreaded process may deadlock. The child execs at once, running nothing
# of JAX's, so the warning does not apply here.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

WAIT = 240.0
STEPS = 20  # pushes per worker: the kill and the removal come while they train


@pytest.fixture(scope="module")
def fake_nodes() -> Iterator[Any]:
    """A Ray cluster of three fake nodes of one CPU each, this process its driver (one for the
    module: it takes 20 s to start here)."""
    from ray.cluster_utils import Cluster

    from hetd.server.pserver_ray import NAMESPACE

    try:
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
    except Exception as exc:  # pragma: no cover - says why instead of failing on the machine
        pytest.skip(f"Ray refuses to start a cluster on this machine: {exc}")
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _hetd(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hetd",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), WAIT)
    return int(proc.returncode or 0), out.decode()


async def test_hetd_cluster_up_places_the_head_and_its_pservers_and_down_removes_them(
    tmp_path: Path, fake_nodes: Any
) -> None:
    """hetd cluster up: the head and two pservers as named actors, one bundle each of the group
        hetd; a real worker trains against the head; status lists them; down stops them all (the head
    drains and saves its final checkpoint: status 0) and removes the group."""
    from hetd.cli.cluster import rows
    from hetd.server.pserver_ray import HEAD, group

    cluster, _ = fake_nodes
    port = _free_port()
    toml = tmp_path / "hetd.toml"
    toml.write_text(
        f'[server]\nport = {port}\nadmin_port = -1\nworker_token = "{WORKER_TOKEN}"\n'
        '[train]\ndataset = "digits"\nmodel = "mlp"\noptimizer = "momentum"\nlr = 0.05\n'
        '[policy]\nname = "asp"\n'
        '[store]\ndir = "state"\ninterval_s = 0.0\n'
        f"[pservers]\nport = {_free_port()}\n"
    )
    up = ["--address", cluster.address, "--pservers", "2", "--config", str(toml)]
    rc, out = await _hetd("cluster", "up", *up, "--strategy", "SPREAD")
    try:
        assert rc == 0, out
        assert "hetd-head up" in out and (tmp_path / "state" / "cluster.toml").exists()
        names = [HEAD, "hetd-pserver-0", "hetd-pserver-1"]
        await until(
            lambda: [r.get("state") for r in rows(ray)] == ["running"] * 3,
            "the head and both pservers running",
            WAIT,
        )
        assert [r["actor"] for r in rows(ray)] == names
        assert len(group(ray).bundle_specs) == 3  # type: ignore[union-attr]
        worker = await start_worker(port, 2)
        await asyncio.wait_for(worker.wait(), WAIT)
        assert worker.returncode == 0, (await worker.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
        rc, out = await _hetd("cluster", "status", "--address", cluster.address)
        assert rc == 0 and out.count("running") == 3, out
    finally:
        rc, out = await _hetd("cluster", "down", "--address", cluster.address)
    assert rc == 0 and "hetd-head stopped (status 0)" in out, out
    assert group(ray) is None and rows(ray) == []
    for name in names:
        with pytest.raises(ValueError):
            ray.get_actor(name)


async def test_two_ray_pservers_survive_a_kill_and_a_node_removal_and_end_with_the_head(
    tmp_path: Path, fake_nodes: Any
) -> None:
    from hetd.server.pserver_ray import RayPservers, place

    cluster, _ = fake_nodes
    place(ray, 2, strategy="STRICT_SPREAD")  # one node each: removing one moves one pserver
    cfg = make_config("asp", optimizer="momentum", lr=0.05, codec="int8")
    cfg = config_mod.replace(cfg, "server", admin_port=-1, stop_timeout_s=60.0)
    cfg = config_mod.replace(cfg, "store", dir=str(tmp_path / "state"), interval_s=0.0)
    cfg = config_mod.replace(cfg, "pservers", log=True, servers=2, port=0, backend="ray")
    daemon = Daemon(cfg)
    port = await daemon.start()
    workers: list[asyncio.subprocess.Process] = []
    try:
        link, procs = daemon.pservers, daemon.pserver_procs
        assert link is not None and isinstance(procs, RayPservers)
        await until(link.ready.is_set, "both pserver actors said where they take parts", WAIT)
        rows = daemon.describe()["decisions"]["processes"]
        assert [r["actor"] for r in rows] == ["hetd-pserver-0", "hetd-pserver-1"]
        assert rows[0]["node"] != rows[1]["node"]  # spread: one node each
        assert ray.get_actor("hetd-pserver-1") is not None  # found by name
        # each pserver runs at the daemon's niceness, not at Ray's workers' (15)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, r["pid"]) for r in rows] == [mine, mine]
        addrs = list(link.addrs)
        workers = [await start_worker(port, STEPS) for _ in range(2)]
        store = daemon.engine.store
        await until(lambda: store.version >= 4, "training under way", WAIT)

        # At once: one pserver's process dies (its actor exits with it and Ray restarts the actor
        # on its node), and the other's node goes (not the head node: that is the cluster's; Ray
        # places its bundle and actor again on the node left free).
        head_node = cluster.head_node.node_id
        moved = next(s for s in procs.slots if s.node != head_node)
        killed = procs.slots[1 - moved.server]
        child, kept = killed.child, killed.node
        assert child is not None
        gone = next(n for n in cluster.list_all_nodes() if n.node_id == moved.node)
        os.kill(child, signal.SIGKILL)
        cluster.remove_node(gone)
        await until(lambda: killed.restarts == 1, "Ray restarted the killed pserver's actor", WAIT)
        assert killed.child != child and killed.node == kept
        assert os.getpriority(os.PRIO_PROCESS, killed.child) == mine  # restarted alike
        await until(lambda: moved.restarts == 1, "the moved pserver came back elsewhere", WAIT)
        assert moved.node not in (gone.node_id, kept)

        for w in workers:
            await asyncio.wait_for(w.wait(), WAIT)
        for w in workers:
            assert w.returncode == 0, (await w.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
        assert link.addrs == addrs  # both came back where the workers send their parts
        assert link.parts.lost == 0 and store.version == 2 * STEPS  # none lost, none twice
        await daemon.checkpoint()
        position = daemon.engine.store.decisions.position  # type: ignore[union-attr]
        await until(lambda: link.durable == [position] * 2, "both saved the checkpoint", WAIT)
        head = dict(store.snapshot().tensors)
        dirs = [tmp_path / "state" / "pservers" / f"slice{s}" for s in range(2)]
        saved = [disk.load(disk.listing(d)[0]).slice for d in dirs]
        joined = join(link.setup.pmap, [s.params for s in saved])
        assert all(joined[k].tobytes() == head[k].tobytes() for k in head)  # bit for bit
    finally:
        for w in workers:
            if w.returncode is None:
                w.kill()
                await w.wait()
        await daemon.stop(final_checkpoint=False)
    with pytest.raises(ValueError):  # stopped: the actors are gone, by name too
        ray.get_actor("hetd-pserver-0")
