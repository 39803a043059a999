"""Start and stop what an end-to-end run needs: simulated replicas and Envoy, on 127.0.0.1.

Everything started here is a child of this Python process, in a session of its own (so a shell's
SIGHUP/SIGTERM aimed at the terminal's process group does not reach it: Envoy started in the
background of a shell has been seen to get SIGTERM when that shell exits), with the kernel asked to
kill it should this process die without cleaning up (PR_SET_PDEATHSIG). `Stack.close()` stops exactly
the processes it started, by pid, and it runs on normal exit, on SIGTERM/SIGINT, and from tests'
tearDown.

Paths come from the environment so CI and developers can point at their builds:
- `CARGO_TARGET_DIR` (default `<repo>/target`): where the release wasm and sim binary are.
- `KVSTEER_WASM`, `KVSTEER_SIM`, `KVSTEER_FLOOD_FEED`, `ENVOY_BIN`: explicit overrides.
- `ENVOY_CPUS` (a `taskset -c` list, e.g. `1`): run Envoy on those CPUs only (benchmarks that keep
  Envoy off the cores of the client and the simulated replicas, as a deployment would).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import envoy_config
from client import Client, Result

REPO = Path(__file__).resolve().parent.parent


class StackError(RuntimeError):
    """A part of the stack could not be started, with what it printed."""


def prom(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` whose labels include `labels` in a Prometheus text
    exposition (a replica's, an adapter's or the simulator's `/metrics`)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, lab = head.partition("{")
        if metric != name:
            continue
        if any(f'{k}="{v}"' not in lab for k, v in labels.items()):
            continue
        try:
            total += float(value)
        except ValueError:
            pass
    return total


def rss_kb(pid: int) -> tuple[int, int]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), in KiB, from /proc."""
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    return rss, hwm


def target_dir() -> Path:
    t = os.environ.get("CARGO_TARGET_DIR")
    p = Path(t) if t else REPO / "target"
    return p if p.is_absolute() else REPO / p


def report_path(p: Path) -> str:
    """How a committed report names a file it used, so it carries no machine's paths: relative to the
    repository; a build output under `CARGO_TARGET_DIR` as the same path under `target/`; anything
    else by its file name alone (as `kvsteer_host_test::artifact::report_path` does)."""
    p = Path(p)
    for base, prefix in ((target_dir(), Path("target")), (REPO, Path("."))):
        try:
            return str(prefix / p.resolve().relative_to(base.resolve()))
        except ValueError:
            pass
    return str(p) if not p.is_absolute() else p.name


def wasm_path() -> Path:
    return Path(
        os.environ.get("KVSTEER_WASM")
        or target_dir() / "wasm32-wasip1" / "release" / "kvsteer_filter.wasm"
    )


def sim_path() -> Path:
    return Path(os.environ.get("KVSTEER_SIM") or target_dir() / "release" / "kvsteer-sim")


def flood_feed_path() -> Path:
    """The feed-only replica of `sim/examples/flood-feed.rs` (a cargo example, not a bin)."""
    return Path(os.environ.get("KVSTEER_FLOOD_FEED")
                or target_dir() / "release" / "examples" / "flood-feed")


def envoy_path() -> Path:
    """The Envoy binary: `ENVOY_BIN`, else the one scripts/envoy-install put in .venv."""
    if os.environ.get("ENVOY_BIN"):
        return Path(os.environ["ENVOY_BIN"])
    out = subprocess.run(
        [str(REPO / "scripts" / "envoy-install")], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def free_ports(n: int) -> list[int]:
    """`n` distinct ports the kernel says are free now (another process may still take one first)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


_PR_SET_PDEATHSIG = 1
# Resolved once here: the child between fork and exec must not load libraries (another thread of
# this process may have held the loader's lock at the fork).
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _child_setup() -> None:
    # Runs in the child between fork and exec: die with the supervisor.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


@dataclass
class Proc:
    """One started process, its log file, and what it is for (in error messages)."""

    what: str
    popen: subprocess.Popen
    log: Path
    lines: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            text = ""
        return "\n".join(text.splitlines()[-n:])

    def stop(self, grace_s: float = 3.0) -> None:
        if self.popen.poll() is not None:
            return
        # The child leads its own session, so its pid is its process group: signal the group so that
        # anything it spawned goes too, and nothing else.
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL now: a replica that dies, not one that shuts down."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=5)


@dataclass
class Replica:
    name: str
    port: int
    proc: Proc
    sim_name: str = ""
    # A feed served by another process than the replica's completions (`Stack.start_flood_feed`):
    # Envoy's `kvsteer_feed_<name>` cluster points there instead of at the replica.
    feed_proc: Proc | None = None
    feed_port: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def feed_endpoint(self) -> str:
        return f"127.0.0.1:{self.feed_port or self.port}"


_live_stacks: list["Stack"] = []


def _close_all(*_args) -> None:
    for s in list(_live_stacks):
        s.close()


def _on_signal(signum, _frame) -> None:
    _close_all()
    # Exit with the conventional status for the signal.
    sys.exit(128 + signum)


atexit.register(_close_all)
for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    if threading.current_thread() is threading.main_thread():
        signal.signal(_sig, _on_signal)


class Stack:
    """Replicas plus (optionally) one Envoy in front of them. Use as a context manager."""

    def __init__(self, workdir: Path | None = None, quiet: bool = True):
        # A directory made here is removed on close unless E2E_KEEP_LOGS=1.
        self.own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvsteer-e2e-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        # Every process ever started here, also those stopped early (their logs are still read).
        self.procs_seen: list[Proc] = []
        self.replicas: list[Replica] = []
        self.envoy: Proc | None = None
        self.listen_port = 0
        self.admin_port = 0
        self.variant = ""
        self.quiet = quiet
        _live_stacks.append(self)

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    # -- processes -------------------------------------------------------------------------------

    def spawn(self, what: str, argv: list[str]) -> Proc:
        # A process started again under the same name (a restarted Envoy) gets a log of its own: the
        # earlier one is still read for VM failures.
        log = self.workdir / f"{what}.log"
        n = 1
        while log.exists():
            n += 1
            log = self.workdir / f"{what}.{n}.log"
        f = open(log, "wb")
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=f,
            start_new_session=True,
            preexec_fn=_child_setup,
            cwd=str(REPO),
        )
        f.close()
        proc = Proc(what, popen, log)
        self.procs.append(proc)
        self.procs_seen.append(proc)

        def pump() -> None:
            # Copy stdout to the log too, keeping lines for readiness checks.
            assert popen.stdout is not None
            with open(log, "ab") as out, popen.stdout:
                for raw in popen.stdout:
                    out.write(raw)
                    out.flush()
                    proc.lines.append(raw.decode(errors="replace").rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()
        return proc

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        if self.own_workdir and os.environ.get("E2E_KEEP_LOGS") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self in _live_stacks:
            _live_stacks.remove(self)

    # -- replicas --------------------------------------------------------------------------------

    def start_replicas(
        self, n: int, extra: list[str] | None = None, prefix: str = "r", first_port: int = 0
    ) -> None:
        """`n` simulated replicas, each its own process (so one can be killed), named r0..r{n-1},
        on free ports, or on first_port.. first_port+n-1 when given."""
        sim = sim_path()
        if not sim.exists():
            raise StackError(
                f"sim binary not found at {sim}: build it with "
                "`cargo build -p kvsteer-sim --release --bin kvsteer-sim` (or set KVSTEER_SIM)"
            )
        ports = [first_port + i for i in range(n)] if first_port else free_ports(n)
        for i, port in enumerate(ports):
            name = f"{prefix}{i}"
            proc = self.spawn(f"replica-{name}", self._replica_argv(sim, name, port, i, extra or []))
            self.replicas.append(Replica(name, port, proc))
        deadline = time.monotonic() + 30
        for r in self.replicas:
            # The sim prints `ready <name> 127.0.0.1:<port>` per replica it serves.
            suffix = f" 127.0.0.1:{r.port}"
            while True:
                ready = [ln for ln in r.proc.lines if ln.startswith("ready ") and ln.endswith(suffix)]
                if ready:
                    r.sim_name = ready[0].split()[1]
                    break
                if not r.proc.alive():
                    raise StackError(f"replica {r.name} exited:\n{r.proc.tail()}")
                if time.monotonic() > deadline:
                    raise StackError(f"replica {r.name} not ready in 30 s:\n{r.proc.tail()}")
                time.sleep(0.02)
            wait_http(f"http://{r.endpoint}/health", 10, r.proc)
        self.say("replicas: " + ", ".join(f"{r.name}={r.endpoint}" for r in self.replicas))

    @staticmethod
    def _replica_argv(sim: Path, name: str, port: int, index: int, extra: list[str]) -> list[str]:
        # One process per replica so a test can kill one. The sim names its replicas
        # `<prefix><i>`; with one replica per process the prefix `<name>_` makes the names distinct
        # (`r0_0`, `r1_0`, ...), and the ready line tells which name a replica answers with.
        return [str(sim), "serve", "--replicas", "1", "--host", "127.0.0.1", "--port", str(port),
                "--name-prefix", f"{name}_", "--seed", str(1000 + index), *extra]

    def start_flood_feed(self, name: str, blocks: int = 0, every_poll: bool = False,
                         delay_ms: int = 0) -> None:
        """Serves replica `name`'s feed from a feed-only process of its own
        (`sim/examples/flood-feed.rs`, made-up blocks) while its completions still go to the
        replica; call before `start_envoy`. Its mode can change later: `flood_mode`."""
        exe = flood_feed_path()
        if not exe.exists():
            raise StackError(
                f"flood-feed not found at {exe}: build it with "
                "`cargo build -p kvsteer-sim --release --example flood-feed` (or set KVSTEER_FLOOD_FEED)"
            )
        r = self.replica(name)
        index = self.replicas.index(r)
        port = free_ports(1)[0]
        argv = [str(exe), str(port), str(blocks), str(index), "--delay-ms", str(delay_ms)]
        if every_poll:
            argv.append("--every-poll")
        r.feed_proc = self.spawn(f"feed-{name}", argv)
        r.feed_port = port
        wait_http(f"http://{r.feed_endpoint}/health", 10, r.feed_proc)

    def flood_mode(self, name: str, **mode: int) -> None:
        """Changes what replica `name`'s flood feed answers (`blocks`, `every_poll`, `delay_ms`);
        it takes a new epoch, so the router's next poll gets a snapshot."""
        q = "&".join(f"{k}={int(v)}" for k, v in mode.items())
        req = urllib.request.Request(
            f"http://{self.replica(name).feed_endpoint}/admin/mode?{q}", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            if resp.status != 200:
                raise StackError(f"flood feed of {name}: status {resp.status}")

    def flood_stats(self, name: str) -> dict[str, int]:
        """What replica `name`'s flood feed has served since its mode last changed: polls, snapshots,
        snapshot_bytes."""
        url = f"http://{self.replica(name).feed_endpoint}/admin/stats"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())

    def by_sim_name(self, sim_name: str) -> "Replica | None":
        """The replica that answers with `x-kvsteer-replica: <sim_name>`."""
        for r in self.replicas:
            if r.sim_name == sim_name:
                return r
        return None

    def replica(self, name: str) -> Replica:
        for r in self.replicas:
            if r.name == name:
                return r
        raise KeyError(name)

    def by_endpoint(self) -> dict[str, str]:
        return {r.endpoint: r.name for r in self.replicas}

    # -- envoy -----------------------------------------------------------------------------------

    def start_envoy(
        self,
        variant: str = "envoy",
        concurrency: int = 2,
        listen_port: int = 0,
        admin_port: int = 0,
        plugin_overrides: dict | None = None,
        wait_feeds: bool = True,
        wasm_overrides: dict | None = None,
        replica_overrides: dict | None = None,
        node_id: str = "",
        extra_clusters: dict[str, str] | None = None,
        pools: dict[str, list[str]] | None = None,
    ) -> None:
        """Envoy with `envoy/<variant>.yaml`, rewritten for this stack's ports and the built wasm.
        `node_id` is passed as `--service-node` (Envoy's node id, which the filter mixes into its
        tie-break seed so that proxies of one fleet break ties differently); empty: none. `pools`
        (pool name -> replica names) splits the replicas over a pooled file's pools
        (`envoy_config.pool_members`)."""
        wasm = wasm_path()
        cfg_doc = envoy_config.load(variant)
        if envoy_config.uses_wasm(cfg_doc) and not wasm.exists():
            raise StackError(
                f"filter not built at {wasm}: build it with "
                "`cargo build -p kvsteer-filter --target wasm32-wasip1 --release` (or set KVSTEER_WASM)"
            )
        fixed = bool(listen_port and admin_port)
        self.listen_port, self.admin_port = (listen_port, admin_port) if fixed else free_ports(2)
        self.variant = variant
        doc = envoy_config.rewrite(
            cfg_doc,
            replicas=[(r.name, r.endpoint) for r in self.replicas],
            listen_port=self.listen_port,
            admin_port=self.admin_port,
            wasm=str(wasm),
            plugin_overrides=plugin_overrides or {},
            wasm_overrides=wasm_overrides or {},
            feeds=self.feed_endpoints(),
            replica_overrides=replica_overrides or {},
            extra_clusters=extra_clusters,
            pools=pools,
        )
        path = self.workdir / f"{variant}.json"
        path.write_text(json.dumps(doc, indent=1))
        envoy = envoy_path()
        last = ""
        for attempt in range(3):
            # Each run its own base id: two Envoys on one machine must not share hot-restart memory.
            base_id = random.randint(1000, 4_000_000)
            argv = [str(envoy), "-c", str(path), "--concurrency", str(concurrency),
                    "--base-id", str(base_id), "--log-level", "warn",
                    "--component-log-level", os.environ.get("E2E_ENVOY_LOG", "wasm:info")]
            if node_id:
                argv += ["--service-node", node_id]
            if os.environ.get("ENVOY_CPUS"):
                argv = ["taskset", "-c", os.environ["ENVOY_CPUS"], *argv]
            self.envoy = self.spawn(f"envoy-{variant}-{attempt}", argv)
            try:
                wait_http(f"http://127.0.0.1:{self.admin_port}/ready", 30, self.envoy)
                break
            except StackError as e:
                last = str(e)
                self.envoy.stop()
                if fixed:
                    raise
                # A port or base id taken by someone else between our check and Envoy's bind: retry
                # on fresh ones.
                self.listen_port, self.admin_port = free_ports(2)
                doc = envoy_config.rewrite(
                    cfg_doc, replicas=[(r.name, r.endpoint) for r in self.replicas],
                    listen_port=self.listen_port, admin_port=self.admin_port, wasm=str(wasm),
                    plugin_overrides=plugin_overrides or {}, wasm_overrides=wasm_overrides or {},
                    feeds=self.feed_endpoints(),
                    replica_overrides=replica_overrides or {}, extra_clusters=extra_clusters,
                    pools=pools)
                path.write_text(json.dumps(doc, indent=1))
        else:
            raise StackError(f"envoy did not become ready:\n{last}")
        self.wait_healthy()
        if wait_feeds and envoy_config.uses_wasm(cfg_doc):
            self.wait_feeds()
        self.say(f"envoy ({variant}): listen 127.0.0.1:{self.listen_port}, "
                 f"admin 127.0.0.1:{self.admin_port}")

    def feed_endpoints(self) -> dict[str, str]:
        """Replicas whose feed is served elsewhere than their completions: name -> `IP:port`."""
        return {r.name: r.feed_endpoint for r in self.replicas if r.feed_port}

    def envoy_logs(self) -> list[str]:
        """The text of every Envoy log this stack wrote (one per process, unreadable ones skipped)."""
        texts = []
        for p in self.procs_seen:
            if not p.what.startswith("envoy"):
                continue
            try:
                texts.append(p.log.read_text(errors="replace"))
            except OSError:
                continue
        return texts

    def node_ids_logged(self) -> list[str]:
        """The node id each filter VM of this stack's Envoys logged when it was configured (its
        "kvsteer: configured ..., node id \"...\"" line), in log order."""
        ids = []
        for text in self.envoy_logs():
            ids.extend(re.findall(r'kvsteer: configured .*, node id "([^"]*)"', text))
        return ids

    def vm_failures(self) -> list[str]:
        """Lines of every Envoy log this stack wrote that tell of a wasm VM failing: a Rust panic
        (logged by the SDK's panic hook), a trap, or anything at critical level. FAIL_OPEN keeps such
        a failure invisible to clients, so the tests look for it here."""
        bad = []
        for text in self.envoy_logs():
            bad.extend(line for line in text.splitlines()
                       if "[critical]" in line or "panicked" in line or "Uncaught" in line)
        return bad

    def close_checked(self) -> None:
        """Closes the stack, then fails if any Envoy it ran logged a VM failure ([`vm_failures`]):
        the end of every test class that shares one stack."""
        failures = self.vm_failures()
        self.close()
        if failures:
            raise AssertionError("the filter's VM failed:\n" + "\n".join(failures[:10]))

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as r:
            return r.read().decode()

    def stats(self, prefix_filter: str = "") -> dict[str, int]:
        """Envoy's counters and gauges (`/stats`), name -> value; histograms are skipped."""
        out: dict[str, int] = {}
        q = f"?filter={prefix_filter}" if prefix_filter else ""
        for line in self.admin(f"/stats{q}").splitlines():
            name, _, value = line.partition(": ")
            try:
                out[name] = int(value)
            except ValueError:
                continue
        return out

    def set_fault(self, name: str, fault: dict) -> None:
        """Sets the simulated replica `name`'s fault knobs (`POST /admin/fault`: restart, slowdown,
        error_rate, feed_outage); an AssertionError, failing the test, unless it answers 200."""
        host, _, port = self.replica(name).endpoint.rpartition(":")
        c = Client(host, int(port))
        try:
            status, _, body = c.request("POST", "/admin/fault", json.dumps(fault).encode(),
                                        {"content-type": "application/json"})
        finally:
            c.close()
        if status != 200:
            raise AssertionError(f"fault {fault} on {name}: {status} {body!r}")

    def metric(self, name: str) -> int:
        """A filter metric (`kvsteer_...`) as Envoy shows it (`wasmcustom.<name>`), 0 when absent."""
        return sum(v for k, v in self.stats(name).items() if k.endswith("." + name) or k == name)

    def host_health(self, cluster: str) -> dict[str, str]:
        """Endpoints of `cluster` and their health flags (`healthy`, or e.g. `/failed_active_hc`)."""
        flags: dict[str, str] = {}
        for line in self.admin("/clusters").splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster and parts[2] == "health_flags":
                flags[parts[1]] = parts[3]
        return flags

    def healthy_hosts(self, cluster: str) -> set[str]:
        return {h for h, f in self.host_health(cluster).items() if f == "healthy"}

    def wait_healthy(self, timeout_s: float = 20) -> None:
        """Until every host of every health-checked cluster passes its checks."""
        clusters = envoy_config.health_checked_clusters(envoy_config.load(self.variant))
        deadline = time.monotonic() + timeout_s
        for c in clusters:
            while True:
                flags = self.host_health(c)
                if flags and all(f == "healthy" for f in flags.values()):
                    break
                if time.monotonic() > deadline:
                    raise StackError(f"cluster {c} not healthy in {timeout_s} s: {flags}")
                time.sleep(0.1)

    def wait_feeds(self, timeout_s: float = 20) -> None:
        """Until every replica's feed has answered at least one poll.

        Sending a first request before the filter has seen any feed would route it on load alone,
        which is correct but not what the tests want to observe.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            polls = {}
            for r in self.replicas:
                polls[r.name] = self.feed_polls(r)
            if all(v > 0 for v in polls.values()):
                return
            if time.monotonic() > deadline:
                raise StackError(f"feeds not polled in {timeout_s} s: {polls}")
            time.sleep(0.1)

    def feed_polls(self, r: Replica) -> int:
        """How many feed requests the replica's feed cluster has completed with a 2xx. Envoy 1.40
        counts each of a filter's callouts twice, under `upstream_rq_2xx` and again under
        `internal.upstream_rq_2xx` (measured: 5 and 5 for 5 requests, `upstream_rq_total` 5), so the
        two are not summed; the larger is taken in case a build counts callouts under one only."""
        prefix = f"cluster.kvsteer_feed_{r.name}."
        s = self.stats(prefix)
        return max(s.get(prefix + "upstream_rq_2xx", 0),
                   s.get(prefix + "internal.upstream_rq_2xx", 0))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def send(self, prompt: list[int], timeout_s: float = 60.0, **kw) -> Result:
        """One completion through Envoy on a fresh connection, so that requests spread over Envoy's
        workers; `kw` as `Client.complete` takes them."""
        c = Client("127.0.0.1", self.listen_port, timeout_s=timeout_s)
        try:
            return c.complete(prompt, **kw)
        finally:
            c.close()


def envoy_fleet(replicas: int, time_scale: str, variant: str = "envoy",
                plugin_overrides: dict | None = None, sim_args: list[str] | None = None,
                replica_overrides: dict | None = None) -> Stack:
    """`replicas` simulated replicas at `time_scale` (with `sim_args` besides) behind Envoy
    (`envoy/<variant>.yaml`, two workers), healthy and with every feed polled; closed again if any
    part fails to start."""
    s = Stack()
    try:
        s.start_replicas(replicas, extra=["--time-scale", time_scale, *(sim_args or [])])
        s.start_envoy(variant, concurrency=2, plugin_overrides=plugin_overrides,
                      replica_overrides=replica_overrides)
    except BaseException:
        s.close()
        raise
    return s


def envoy_validate(doc: dict) -> tuple[bool, str]:
    """Envoy's own check of a bootstrap (`--mode validate`): every typed config is parsed, and wasm
    filters are loaded and configured, so the filter itself judges its plugin configuration."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(doc, f)
        path = f.name
    try:
        p = subprocess.run(
            [str(envoy_path()), "--mode", "validate", "-c", path,
             "--base-id", str(random.randint(1000, 4_000_000)), "--log-level", "warn"],
            capture_output=True, text=True, timeout=120, cwd=str(REPO),
        )
    finally:
        os.unlink(path)
    return p.returncode == 0, (p.stdout + p.stderr)[-3000:]


def wait_http(url: str, timeout_s: float, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise StackError(f"{proc.what} exited ({proc.popen.returncode}):\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
                last = f"status {r.status}"
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            last = str(e)
        time.sleep(0.05)
    tail = proc.tail() if proc is not None else ""
    raise StackError(f"{url} not ready in {timeout_s} s ({last})\n{tail}")
