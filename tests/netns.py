"""Two hosts on one machine: two network namespaces joined by a veth pair.

`TwoHosts` makes namespaces A and B holding 10.231.N.1 and 10.231.N.2 (the project's own test
range, N from the process id), runs commands in either (`ip netns exec`, which execs them: the
process is the command's, a signal reaches it), and removes the namespaces, their links and
every process started in them at exit. It needs root and iproute2; `unavailable()` says why they
cannot be made here, for a test's skip. `serve` starts a specdec server on a host and waits for
its ready file; tests/test_two_hosts.py and scripts/two_hosts.py put the services on these hosts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SUBNET = "10.231"


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"sdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoHosts:
    """Hosts "a" and "b" (see the module doc); a context manager."""

    def __init__(self, tag: str = ""):
        n = os.getpid() % 250 + 1
        self.names = {"a": f"sd{tag}{os.getpid()}a", "b": f"sd{tag}{os.getpid()}b"}
        self.ips = {"a": f"{SUBNET}.{n}.1", "b": f"{SUBNET}.{n}.2"}
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> TwoHosts:
        a, b = self.names["a"], self.names["b"]
        veth_a, veth_b = f"{a}v", f"{b}v"
        try:
            for command in (
                ["netns", "add", a],
                ["netns", "add", b],
                ["link", "add", veth_a, "type", "veth", "peer", "name", veth_b],
                ["link", "set", veth_a, "netns", a],
                ["link", "set", veth_b, "netns", b],
                ["-n", a, "addr", "add", f"{self.ips['a']}/24", "dev", veth_a],
                ["-n", b, "addr", "add", f"{self.ips['b']}/24", "dev", veth_b],
                ["-n", a, "link", "set", veth_a, "up"],
                ["-n", b, "link", "set", veth_b, "up"],
                ["-n", a, "link", "set", "lo", "up"],
                ["-n", b, "link", "set", "lo", "up"],
            ):
                subprocess.run(["ip", *command], check=True, capture_output=True, text=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def popen(self, host: str, argv: list[str], log: Path | None = None, **kwargs) -> subprocess.Popen:
        """Start `argv` on `host`; its output to `log` (else discarded). Killed at exit."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *argv], stdout=out, stderr=subprocess.STDOUT, **kwargs
        )
        if log is not None:
            out.close()
        self.procs.append(proc)
        return proc

    def serve(self, host: str, command: str, args: list, folder: Path, **kwargs) -> str:
        """`python -m cli COMMAND ARGS` on `host`, bound to its address (`--host`, `--port 0`, a ready
        file in `folder`, its log there too); its HOST:PORT once it serves (AssertionError if it
        does not within 300 s)."""
        ready, log = folder / f"{command}.ready", folder / f"{command}.log"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "cli", command, "--host", self.ips[host], "--port", "0", "--ready-file"]
        proc = self.popen(host, [*argv, str(ready), *map(str, args)], log=log, **kwargs)
        deadline = time.monotonic() + 300
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists() and proc.poll() is None, f"{command} did not start:\n{log.read_text()}"
        return json.loads(ready.read_text())["address"]

    def run(self, host: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` on `host` to its end; its output captured as text."""
        return subprocess.run(
            ["ip", "netns", "exec", self.names[host], *argv], capture_output=True, text=True, **kwargs
        )

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for name in self.names.values():  # deleting a namespace deletes its end of the veth, so both
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
