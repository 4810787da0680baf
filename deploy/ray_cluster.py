"""A local single-node Ray cluster that outlives the command that started it.

`specdec ray up` without --address starts one: `ray start --head --block` in a session of
its own (so it survives the CLI), on a free port, with token authentication on and the
dashboard, if any, on loopback only. Its address and the head process's pid go to a state
file, so `specdec ray status` finds the cluster and `specdec ray down` stops it: SIGTERM to
the head process, which stops the node's processes (draining is switched off: nothing here
needs it).

The caller passes the environment in; this module reads none.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# The head's `ray start` runs from this interpreter, so it is the Ray this process imports.
RAY_CLI = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


@dataclass(frozen=True)
class LocalCluster:
    address: str  # GCS HOST:PORT
    pid: int  # the `ray start --block` process, leader of its own process group
    log: str  # its output


def auth_env(env: dict[str, str]) -> dict[str, str]:
    """The variables that switch Ray token authentication on, generating a token if none exists.

    Ray reads the token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; the
    last is written here (by Ray's own `ray get-auth-token --generate`) when none is set.
    """
    if env.get("RAY_AUTH_MODE", "token") != "token":
        return {}  # the user opted out (RAY_AUTH_MODE=disabled)
    if not (env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH")):
        subprocess.run([*RAY_CLI, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    return {"RAY_AUTH_MODE": "token"}


def start(
    state_file: Path,
    env: dict[str, str],
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    dashboard: bool = True,
    timeout: float = 120.0,
) -> LocalCluster:
    """Start the head; returns once its GCS accepts connections."""
    import ray

    ip = ray.util.get_node_ip_address()
    port = free_port()
    cmd = [*RAY_CLI, "start", "--head", "--block", f"--port={port}", "--disable-usage-stats"]
    cmd += ["--dashboard-host=127.0.0.1"] if dashboard else ["--include-dashboard=false"]
    cmd += [f"--num-cpus={num_cpus:g}"] if num_cpus is not None else []
    cmd += [f"--num-gpus={num_gpus:g}"] if num_gpus is not None else []
    state_file.parent.mkdir(parents=True, exist_ok=True)
    log = state_file.with_suffix(".log")
    env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    cluster = LocalCluster(f"{ip}:{port}", proc.pid, str(log))
    state_file.write_text(json.dumps(asdict(cluster)))
    try:
        _wait_for_head(proc, cluster, ip, port, timeout)
    except BaseException:  # Ctrl-C or SIGTERM while it starts too: the head is in a session of its own
        stop(cluster, state_file)
        raise
    return cluster


def _wait_for_head(proc: subprocess.Popen, cluster: LocalCluster, ip: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with code {proc.returncode}:\n{_tail(Path(cluster.log))}")
        try:
            socket.create_connection((ip, port), timeout=1).close()
            return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the local Ray head did not start within {timeout:.0f} s:\n{_tail(Path(cluster.log))}")
        time.sleep(0.2)


def load(state_file: Path) -> LocalCluster | None:
    """The cluster a state file describes, if its head is still running."""
    if not state_file.exists():
        return None
    cluster = LocalCluster(**json.loads(state_file.read_text()))
    return cluster if _is_our_head(cluster) else None


def stop(cluster: LocalCluster, state_file: Path, timeout: float = 30.0) -> None:
    """Stop the head and the processes of its node; forget the state file."""
    if _is_our_head(cluster):
        os.kill(cluster.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(cluster.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:  # whatever is left of its process group (the group id is the head's pid)
            os.killpg(cluster.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    state_file.unlink(missing_ok=True)
    Path(cluster.log).unlink(missing_ok=True)


def _is_our_head(cluster: LocalCluster) -> bool:
    """Whether the pid is still that `ray start` (and not a process that reused the pid)."""
    try:
        cmdline = Path(f"/proc/{cluster.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    port = cluster.address.rsplit(":", 1)[1]
    return b"--head" in cmdline and f"--port={port}".encode() in cmdline and _alive(cluster.pid)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; its parent has not reaped it yet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
