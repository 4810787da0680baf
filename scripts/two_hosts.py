"""Two hosts on this machine, by hand (`make two-hosts`): the default pair split across two network
namespaces joined by a veth pair, as tests/test_two_hosts.py runs it with tiny models.

Host B runs the target service, host A the draft service and the orchestrator, each bound to its
host's address (10.231.N.x), with TLS everywhere, mutual TLS from the orchestrator to the services
and separate tokens (the clients' opens the orchestrator only). Then, from host A: a greedy request
through the split and the same request to the target alone (equal texts, both speeds); the draft
killed with SIGKILL and a request served target-only while the orchestrator says "degraded"; the
draft started again, found by the orchestrator, and a request speculating again. Needs root and
iproute2; everything is removed at the end (Ctrl-C too).

    python scripts/two_hosts.py [--prompt TEXT] [--max-tokens N] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.weights import models  # noqa: E402
from tests import netns  # noqa: E402
from tests.certs import make_pki  # noqa: E402

CLIENT_TOKEN_FILE, SERVICE_TOKEN = "client-token", "two-hosts-service-token"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default="Explain how a refrigerator keeps food cold.")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--keep", action="store_true", help="leave the hosts up until Ctrl-C, for your own requests")
    args = parser.parse_args()
    why = netns.unavailable()
    if why:
        print(f"two-hosts: {why}", file=sys.stderr)
        return 1
    models.ensure_default_converted()  # once, before the services start (their progress is not shown)
    if models.llamacpp_installed():
        models.draft_gguf_path()
    folder = Path(tempfile.mkdtemp(prefix="specdec-two-hosts-"))
    with netns.TwoHosts() as hosts:
        pki = make_pki(folder / "pki", "two-hosts", ips=tuple(hosts.ips.values()))
        (folder / CLIENT_TOKEN_FILE).write_text("two-hosts-client-token")
        tls = ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key]
        base = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_AUTH_TOKEN", "SPECDEC_SERVICE_AUTH_TOKEN")}
        services = {"cwd": ROOT, "env": {**base, "SPECDEC_AUTH_TOKEN": SERVICE_TOKEN}}
        step(f"host B ({hosts.ips['b']}): the target service")
        target = hosts.serve("b", "target-service", [*tls, "--tls-client-ca", pki.ca], folder, **services)
        step(f"host A ({hosts.ips['a']}): the draft service and the orchestrator")
        draft = hosts.serve("a", "draft-service", [*tls, "--tls-client-ca", pki.ca], folder, **services)
        client_token = (folder / CLIENT_TOKEN_FILE).read_text()
        address = hosts.serve(
            "a", "orchestrator", ["--draft-address", draft, "--target-address", target, *tls, "--service-tls-ca",
            pki.ca, "--service-tls-cert", pki.client_cert, "--service-tls-key", pki.client_key], folder, cwd=ROOT,
            env={**base, "SPECDEC_AUTH_TOKEN": client_token, "SPECDEC_SERVICE_AUTH_TOKEN": SERVICE_TOKEN},
        )  # fmt: skip
        print(f"  target {target}, draft {draft}, orchestrator {address}; logs in {folder}")
        client = ["--address", address, "--tls-ca", pki.ca, "--auth-token-file", folder / CLIENT_TOKEN_FILE]

        def generate(*extra) -> dict:
            argv = [sys.executable, "-m", "cli", "generate", args.prompt, "--json", "--max-tokens", args.max_tokens]
            out = hosts.run("a", [*map(str, argv), *map(str, client), *extra], cwd=ROOT, env=base)
            if out.returncode != 0:
                raise SystemExit(f"two-hosts: generate failed: {out.stderr}")
            return json.loads(out.stdout)

        def status() -> str:
            argv = [sys.executable, "-m", "cli", "status", "--json", *map(str, client)]
            out = hosts.run("a", argv, cwd=ROOT, env=base)
            return json.loads(out.stdout)["status"] if out.stdout else out.stderr.strip()

        step("a request through the split, then the target alone (from host A)")
        split, alone = generate(), generate("--no-speculation")
        for name, r in (("split", split), ("target alone", alone)):
            s = r["stats"]
            print(f"  {name}: {s['tokens_per_second']:.1f} tok/s, acceptance {s.get('acceptance_rate', 0):.2f}")
        print(f"  same tokens: {split['token_ids'] == alone['token_ids']}")
        step("the draft killed (SIGKILL)")
        draft_proc = next(p for p in hosts.procs if "draft-service" in p.args)
        draft_proc.send_signal(signal.SIGKILL)
        draft_proc.wait()
        degraded = generate()
        print(f"  a request: {degraded['stats']['tokens_per_second']:.1f} tok/s, rounds without the draft "
              f"{degraded['stats'].get('rounds_without_draft', 0)}, same tokens: "
              f"{degraded['token_ids'] == alone['token_ids']}; the orchestrator says: {status()}")  # fmt: skip
        step("the draft started again on its address")
        port = draft.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "cli", "draft-service", "--host", hosts.ips["a"], "--port", port]
        hosts.popen("a", [*argv, *map(str, tls), "--tls-client-ca", str(pki.ca)], log=folder / "again.log", **services)
        deadline = time.monotonic() + 300
        while status() != "ok" and time.monotonic() < deadline:
            time.sleep(1)
        back = generate()
        print(f"  the orchestrator says: {status()}; a request: {back['stats']['tokens_per_second']:.1f} tok/s, "
              f"acceptance {back['stats'].get('acceptance_rate', 0):.2f}")  # fmt: skip
        if args.keep:
            step("up until Ctrl-C; from host A:")
            print(f"  ip netns exec {hosts.names['a']} specdec generate 'Hi' " + " ".join(map(str, client)))
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
    return 0


def step(text: str) -> None:
    print(f"two-hosts: {text}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
