"""The multi-node Slurm lab as a pytest fixture (tests/lab/slurm_multi.sh; root only).

`mlab` brings up NODES compute nodes, each a network namespace with its own address and host
name, one slurmctld on the bridge `BRIDGE_ADDR`, and points this process's Slurm commands (and
every job it submits) at that cluster through SLURM_CONF. At the end every job is cancelled and
the lab is taken down: namespaces, bridge, daemons, state. Nothing is shared with
slurm_up.sh's single-node cluster, which may run at the same time."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "lab", "slurm_multi.sh")
CONF = "/run/otela-mlab/slurm.conf"
BRIDGE_ADDR = "10.79.0.1"          # this host on the lab's bridge: where nodes find the ingress
NODES, GPUS_PER_NODE = 4, 1        # the placer sees 4 nodes x 1 GPU
PARTITION = "mlab"


def node_addr(i):
    """The address of node otm<i> (1-based)."""
    return f"10.79.0.{10 + i}"


def _run(*args, env=None, timeout=180):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def mlab():
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces and slurmd (tests/lab/slurm_multi.sh)")
    if not all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "ip", "nsenter")):
        pytest.skip("Slurm or iproute2 not installed: run tests/lab/slurm_up.sh once")
    up = _run("up", env={"NODES": str(NODES), "GPUS_PER_NODE": str(GPUS_PER_NODE)})
    if up.returncode != 0:
        _run("down")
        pytest.skip(f"could not bring up the multi-node lab: {(up.stdout + up.stderr).strip().splitlines()[-3:]}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = CONF
    try:
        yield {"nodes": [f"otm{i}" for i in range(1, NODES + 1)], "partition": PARTITION,
               "gpus_per_node": GPUS_PER_NODE, "host": BRIDGE_ADDR}
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        _run("down")
