"""Multi-node jobs: a two-node Ray cluster on this machine (two `ray start` processes, each
node offering its own custom resource, token authentication on), `ray job submit --working-dir
<repo>` of `python -m disagg train` against it as the README shows it: the trainer and the engines
on different nodes and the weight sync between them, the run directory outside Ray's working-dir
package, checkpoints at a file:// URL, and a second job that resumes from that URL.

Everything is started through the real `ray` CLI in subprocesses of their own, in a temp dir of
its own, on free ports; the teardown kills every process of that cluster (by process group,
then by pid) so nothing is left for the tests that start their own local Ray with ray.init().
This process never connects to the cluster and never sets RAY_ADDRESS.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from disagg.paths import ray_package_of
from tests.conftest import SMALL_CLI

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
STEPS = 2


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class TwoNodeCluster:
    """A head node with {"trainer_node": 4} and a second node with {"rollout_node": 4}, 2 CPUs each."""

    def __init__(self, root: Path):
        self.root = root
        self.gcs_port, self.dashboard_port, self.client_port = _free_ports(3)
        # `.venv/bin/ray start` without the venv on PATH, as a newcomer runs it: Ray starts its
        # workers with the venv's Python, but a job's entrypoint is a shell command looked up on
        # this PATH, so the job names the venv's Python by its absolute path. Token authentication
        # as the README sets it up: RAY_AUTH_MODE=token and one token, shared through RAY_AUTH_TOKEN,
        # on both nodes and in the shell that runs `ray job submit`.
        venv_bin = str(Path(sys.executable).parent)
        path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
        self.env = {**os.environ, "PATH": path, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "RAY_DEDUP_LOGS": "0"}
        self.env.pop("RAY_AUTH_TOKEN_PATH", None)
        self.env.pop("RAY_ADDRESS", None)
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[dict] = []

    def start(self) -> None:
        self._start_node("head", {"trainer_node": 4}, ["--head", "--port", str(self.gcs_port), "--include-dashboard",
                                                        "true", "--dashboard-host", "127.0.0.1", "--dashboard-port",
                                                        str(self.dashboard_port), "--ray-client-server-port",
                                                        str(self.client_port)], 1)
        self.nodes = self._start_node("worker", {"rollout_node": 4}, ["--address", f"127.0.0.1:{self.gcs_port}"], 2)

    def _start_node(self, name: str, resources: dict, args: list[str], n: int, tries: int = 3) -> list[dict]:
        """Start one node and wait for ``n`` alive nodes. `ray start` gives a raylet a fixed 30 s
        to register with the GCS; on a loaded 2-core CI machine a worker's raylet once missed it
        (CI 2026-11-27: "The current node timed out during startup"). That attempt's process group
        is killed and the node started again, in a fresh temp dir, up to ``tries`` times."""
        for attempt in range(1, tries + 1):
            self._start(name if attempt == 1 else f"{name}-try{attempt}", resources, args)
            try:
                return self.wait_nodes(n, 120)
            except _NodeExited as e:
                if e.proc is not self.procs[-1] or attempt == tries:
                    raise AssertionError(str(e)) from None
                print(f"`ray start` of the {name} node exited ({e.proc.returncode}); starting it again "
                      f"({attempt + 1}/{tries})")
                self.procs.pop()
                _kill_group(e.proc.pid, signal.SIGKILL)
        raise AssertionError("unreachable")

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def working_dir_packages(self) -> list[Path]:
        """The head's unpacked `--working-dir` uploads (the jobs' drivers start in them)."""
        return sorted((self.root / "head").glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*"))

    def _start(self, name: str, resources: dict, args: list[str]) -> None:
        # Two nodes on one host: each its own temp dir and its own agent/manager ports (the
        # defaults, e.g. the dashboard agent's 52365, would collide with each other and with other
        # Ray instances on this machine). Ray replaces 127.0.0.1 with the host's own address.
        ports = _free_ports(6)
        temp = self.root / name
        temp.mkdir()
        cmd = [RAY, "start", "--block", *args, "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
               "--resources", json.dumps(resources), "--object-store-memory", str(100 * 1024 * 1024),
               "--temp-dir", str(temp), "--disable-usage-stats",
               "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
               "--dashboard-agent-listen-port", str(ports[2]), "--dashboard-agent-grpc-port", str(ports[3]),
               "--runtime-env-agent-port", str(ports[4]), "--metrics-export-port", str(ports[5])]
        log = open(self.root / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))
        log.close()

    def ray(self, *args: str, timeout_s: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([RAY, *args], capture_output=True, text=True, timeout=timeout_s,
                              env={**self.env, **(env or {})})

    def wait_nodes(self, n: int, timeout_s: float) -> list[dict]:
        """The alive nodes (`ray list nodes`) once there are ``n``."""
        deadline = time.monotonic() + timeout_s
        out = None
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise _NodeExited(p, f"`ray start` exited ({p.returncode}):\n{self.logs()}")
            out = self.ray("list", "nodes", "--address", self.dashboard, "--format", "json", "--filter",
                           "state=ALIVE", timeout_s=60)
            if out.returncode == 0:
                nodes = json.loads(out.stdout) if out.stdout.lstrip().startswith("[") else []  # or "No resource"
                if len(nodes) == n:
                    return nodes
            time.sleep(2)
        raise AssertionError(f"{n} Ray nodes not up after {timeout_s:.0f}s: {out and out.stderr[-2000:]}\n"
                             f"{self.logs()}")

    def node_with(self, resource: str) -> dict:
        (node,) = [n for n in self.nodes if resource in n["resources_total"]]
        return node

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """Kill every process of this cluster: the `ray start` process groups, then any process
        that escaped them (workers, the job's driver: their command line or environment names
        this cluster's temp dir or GCS port)."""
        for p in self.procs:
            _kill_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3  # `ray start --block` may hang draining a node whose GCS is gone
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        marks = (str(self.root).encode(), f"RAY_ADDRESS={_host_ip()}:{self.gcs_port}".encode())
        for _ in range(3):
            left = [pid for pid in _pids() if pid != os.getpid() and any(m in _proc_text(pid) for m in marks)]
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(1)


class _NodeExited(Exception):
    def __init__(self, proc: subprocess.Popen, message: str):
        super().__init__(message)
        self.proc = proc


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _proc_text(pid: int) -> bytes:
    text = b""
    for part in ("cmdline", "environ"):
        try:
            text += Path(f"/proc/{pid}/{part}").read_bytes()
        except OSError:
            pass
    return text


def _host_ip() -> str:
    import ray._private.services

    return ray._private.services.get_node_ip_address()


@pytest.fixture(scope="module")
def two_nodes():
    root = Path(tempfile.mkdtemp(prefix="dg-mn-", dir="/tmp"))  # short: Ray's socket paths live under it
    cluster = TwoNodeCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert "RAY_ADDRESS" not in os.environ


def _job_status(cluster: TwoNodeCluster, job_id: str) -> str:
    out = cluster.ray("list", "jobs", "--address", cluster.dashboard, "--format", "json", "--filter",
                      f"submission_id={job_id}", timeout_s=60)
    jobs = json.loads(out.stdout) if out.returncode == 0 and out.stdout.lstrip().startswith("[") else []
    return jobs[0]["status"] if jobs else "UNKNOWN"


def _submit(cluster: TwoNodeCluster, job_id: str, entrypoint: list[str]) -> tuple[str, str]:
    """`ray job submit --working-dir <repo>`; waits for the job's end: (status, its log)."""
    t0 = time.monotonic()
    # The upload follows .gitignore, so it carries no generated gRPC stubs: the uploaded package
    # (first on the path of the driver and every actor) generates them from protos/ on import.
    sub = cluster.ray("job", "submit", "--address", cluster.dashboard, "--submission-id", job_id, "--no-wait",
                      "--working-dir", str(REPO), "--", *entrypoint, timeout_s=300)
    assert sub.returncode == 0, f"ray job submit failed:\n{sub.stdout[-3000:]}\n{sub.stderr[-3000:]}"
    status, deadline = "PENDING", time.monotonic() + 900
    while status in ("PENDING", "RUNNING", "UNKNOWN") and time.monotonic() < deadline:
        time.sleep(2)
        status = _job_status(cluster, job_id)
    logs = cluster.ray("job", "logs", job_id, "--address", cluster.dashboard, timeout_s=60).stdout
    if status in ("PENDING", "RUNNING", "UNKNOWN"):
        cluster.ray("job", "stop", job_id, "--address", cluster.dashboard, "--no-wait", timeout_s=60)
    wall_s = time.monotonic() - t0
    print(f"job {job_id}: {status} after {wall_s:.0f}s")
    assert status == "SUCCEEDED", f"job {job_id} ended {status} after {wall_s:.0f}s; its log:\n{logs[-12000:]}"
    return status, logs


def _train_entrypoint(home: Path, model_cache: Path, *args: str) -> list[str]:
    # The README's entrypoint: the venv's Python by absolute path (`$PWD/.venv/bin/python`), no
    # run directory given. `env HOME=` keeps the driver's default root (~/disagg-runs, the one for
    # a driver inside Ray's package) in this test's temp dir; the actors keep their HOME.
    return ["env", f"HOME={home}", sys.executable, "-m", "disagg", "train", *SMALL_CLI,
            f"model.cache_dir={model_cache}", "+cluster.trainer_resources.trainer_node=1",
            "+cluster.rollout_resources.rollout_node=1", *args]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_job(two_nodes, model_cache, tmp_path_factory):
    """`STEPS` steps submitted with no run directory and checkpoints to a file:// URL."""
    tmp = tmp_path_factory.mktemp("job")
    home, ckpt_url = tmp / "home", f"file://{tmp}/shared/ckpt"
    home.mkdir()
    _, logs = _submit(two_nodes, f"disagg-multinode-{os.getpid()}", _train_entrypoint(
        home, model_cache, f"trainer.total_steps={STEPS}", f"trainer.checkpoint_every={STEPS}",
        f"trainer.checkpoint_dir={ckpt_url}"))
    return {"home": home, "ckpt_dir": tmp / "shared" / "ckpt", "ckpt_url": ckpt_url, "logs": logs,
            "runs": sorted((home / "disagg-runs").iterdir())}


def test_ray_job_submit_places_trainer_and_engines_on_different_nodes(two_nodes, first_job):
    cluster, logs = two_nodes, first_job["logs"]
    (run_dir,) = first_job["runs"]

    # Every trainer rank on the trainer_node node, every engine on the rollout_node node.
    trainer_node = cluster.node_with("trainer_node")["node_id"]
    rollout_node = cluster.node_with("rollout_node")["node_id"]
    assert trainer_node != rollout_node
    placement = json.loads((run_dir / "placement.json").read_text())
    assert [(t["rank"], t["node_id"]) for t in placement["trainer"]] == [(0, trainer_node)], placement
    assert [(e["engine_id"], e["node_id"]) for e in placement["rollout"]] == [(0, rollout_node)], placement

    # The weights crossed between the nodes every step, and the engines served each new version.
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)), logs[-5000:]
    assert all(r["weight_sync/bytes"] > 0 and r["samples/trained"] > 0 for r in recs)
    assert [r["policy_version"] for r in recs] == list(range(2, STEPS + 2))


def test_the_submitted_run_lives_outside_rays_package(two_nodes, first_job):
    # The driver started inside Ray's working-dir package, so the run went to ~/disagg-runs.
    (run_dir,) = first_job["runs"]
    packages = two_nodes.working_dir_packages()
    assert packages, "no unpacked working_dir on the head node"
    assert ray_package_of(run_dir) is None and not any(run_dir.is_relative_to(p) for p in packages)
    assert [p for p in packages if (p / "runs").exists()] == []  # nothing written into the package
    assert f"run directory: {run_dir}" in first_job["logs"]
    assert (run_dir / "metrics.jsonl").stat().st_size > 0 and (run_dir / "config.json").is_file()
    # The checkpoint went to the URL, not into the run directory, and names the run it belongs to.
    ckpt = first_job["ckpt_dir"] / f"step_{STEPS:06d}"
    state = json.loads((ckpt / "state.json").read_text())
    assert (state["step"], state["policy_version"], state["run_dir"]) == (STEPS, STEPS + 1, str(run_dir))
    assert {"model.safetensors", "optimizer.pt", "rng_rank0.pt", "config.json"} <= {p.name for p in ckpt.iterdir()}
    assert not (run_dir / "checkpoints").exists()


def test_a_second_job_resumes_from_the_checkpoint_url(two_nodes, first_job, model_cache):
    (run_dir,) = first_job["runs"]
    url = first_job["ckpt_url"]
    _, logs = _submit(two_nodes, f"disagg-multinode-resume-{os.getpid()}", _train_entrypoint(
        first_job["home"], model_cache, f"resume={url}", f"trainer.total_steps={STEPS + 1}",
        f"trainer.checkpoint_every={STEPS}"))
    # It went on in the run directory the checkpoint records: steps, versions and metrics continue.
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 2)), logs[-5000:]
    assert [r["policy_version"] for r in recs] == list(range(2, STEPS + 3))
    entry = json.loads((run_dir / "resume.jsonl").read_text())
    assert (entry["checkpoint"], entry["step"]) == (f"{url}/step_{STEPS:06d}", STEPS)
    # The trainer (one node) and the engine (the other) each loaded their node's copy of the
    # checkpoint, and they hold the same weights: the engine's behaviour log-probs are the trainer's.
    assert list(model_cache.glob(f"checkpoints/step_{STEPS:06d}-*/model.safetensors"))
    assert recs[STEPS]["train/kl_behaviour"] < 1e-4
    # The resumed run checkpoints to the URL it resumed from.
    assert json.loads((run_dir / "config.json").read_text())["trainer"]["checkpoint_dir"] == url
    state = json.loads((first_job["ckpt_dir"] / f"step_{STEPS + 1:06d}" / "state.json").read_text())
    assert (state["step"], state["run_dir"]) == (STEPS + 1, str(run_dir))


# Runs in a driver of its own on the cluster (no vLLM): node lists resolve to the named nodes,
# and what cannot be placed fails before any placement group is made.
_POOLS_SCRIPT = r"""
import json, sys
import ray
from ray.util.placement_group import placement_group_table
from disagg.cluster import create_pools
from disagg.config import load_config
from disagg.errors import ConfigError

trainer_node, rollout_node = sys.argv[1:3]
ray.init(log_to_driver=False)
cfg = load_config({"cluster": {"trainer_nodes": [trainer_node], "rollout_nodes": [rollout_node]},
                   "trainer": {"num_workers": 2}, "rollout": {"num_engines": 2}})
pools = create_pools(cfg, "cpu")
out = {"trainer": placement_group_table(pools.trainer_pg)["bundles_to_node_id"],
       "rollout": placement_group_table(pools.rollout_pg)["bundles_to_node_id"],
       "rollout_label_selector": pools.rollout_label_selector}
for name, cluster in [("unknown_node", {"trainer_nodes": ["203.0.113.7"]}),
                      ("missing_resource", {"rollout_resources": {"gpu_box": 1}}),
                      ("node_too_small", {"rollout_nodes": [rollout_node]})]:
    try:
        create_pools(load_config({"cluster": cluster, "rollout": {"num_engines": 3}}), "cpu")
        out[name] = None
    except ConfigError as e:
        out[name] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_node_lists_pin_the_pools_and_bad_placement_fails_fast(two_nodes):
    cluster = two_nodes
    trainer_node = cluster.node_with("trainer_node")["node_id"]
    rollout_node = cluster.node_with("rollout_node")["node_id"]
    env = {**cluster.env, "RAY_ADDRESS": f"127.0.0.1:{cluster.gcs_port}"}
    proc = subprocess.run([sys.executable, "-c", _POOLS_SCRIPT, trainer_node, rollout_node], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert set(out["trainer"].values()) == {trainer_node}
    assert set(out["rollout"].values()) == {rollout_node}
    assert out["rollout_label_selector"] == {"ray.io/node-id": rollout_node}
    assert "cluster.trainer_nodes=['203.0.113.7']" in out["unknown_node"]
    assert trainer_node in out["unknown_node"] and rollout_node in out["unknown_node"]
    assert "cluster.rollout_resources.gpu_box=1" in out["missing_resource"]
    assert f"cluster.rollout_nodes=['{rollout_node}']" in out["node_too_small"]
    assert "needs 3 CPU" in out["node_too_small"]
