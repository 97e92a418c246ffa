"""``fleetserve launch``: a router plus N engine instances, started and stopped together.

::

    fleetserve launch                                  # SmolLM2, 2 instances, cache_aware
    fleetserve launch --workers 4 --policy round_robin --dtype float32 --max-total-tokens 65536
    fleetserve launch --workers 2 --tp-size 2 --dp-size 2 --enable-dp-attention   # per-instance flags

Flags this command does not know are passed to every instance (``fleetserve
serve``, or ``fleetserve sim-worker`` with ``--worker-kind sim``); ``--host``
and the ports are set here: the router listens on ``--port``, instance ``i`` on
``--worker-base-port + i``. Extra router flags go in ``--router-args "..."``; a ``--host`` /
``--port`` there moves the router alone, and launch follows it (``launch/router_address.py``).
A ``--kv-events-config`` is given to instance ``i`` with its endpoints' ports moved up by
``i x`` the instance's DP size, so that no two instances bind the same port (``launch/kv_ports.py``);
every port the launch will listen on (router, instances, their KV-event and replay sockets) is
checked for collisions before anything starts (``launch/port_plan.py``), and so are the router's
flags (``launch/router_check.py``: the router's own parser and checks, in a child process).

Life cycle:

1. start every instance, each in its own process group (``start_new_session``),
   so that stopping the group also stops the instance's scheduler processes;
2. wait until every instance answers ``GET /health`` with 200 (fail fast if
   one exits, give up after ``--startup-timeout``); then start the router and
   wait for its ``/health``; print the router URL and a curl example;
3. watch the processes: a dead instance is reported, removed from the router
   (``POST /remove_worker?url=``) and, with ``--restart-workers``, started
   again on its port and re-registered (``POST /add_worker?url=``) once
   healthy; a dead router ends the launch;
4. on SIGINT/SIGTERM/SIGHUP (or a dead router) send SIGTERM to the router, which lets its
   requests in flight finish for up to ``--shutdown-grace`` seconds (passed as its
   ``--shutdown-grace-period-secs``) while the instances still serve them, then to every
   instance's process group; SIGKILL what is left past the grace, and return. If this
   process is killed outright (SIGKILL), each child gets SIGTERM from the kernel
   (``PR_SET_PDEATHSIG``, Linux), so nothing outlives the launch.

Before step 1, the instances' memory is estimated (``launch/memory.py``: weights + KV pool +
measured overhead) and a fleet that would not fit in ``MemAvailable`` is refused with one line
(``--skip-memory-check`` starts it anyway); the instance flags are checked first, for every
``--worker-kind`` and with ``--skip-memory-check`` too: one line naming the bad flag, exit code 2.

Output: every child writes to a pipe and each of its lines is printed here as ``[name] line``
(``launch/output.py``); ``--log-dir DIR`` also appends them, unprefixed, to ``DIR/<name>.log``.
Instances log no line per request unless ``--access-log`` (``serve`` gets
``--disable-uvicorn-access-log``). ``--port 0``: a free port is picked here and printed before
the router starts.

Each child's PID is printed (``pid=``) so that scripts and tests can check that
none is left behind.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fleetserve.entrypoints.cli_parser import OneLineParser
from fleetserve.launch.kv_ports import (check_kv_event_ports, default_kv_events_config, given as kv_events_given,
                                        instance_kv_events_args)
from fleetserve.launch.output import child_env, drain, say, start_copy
from fleetserve.launch.port_plan import first_busy, first_collision, plan
from fleetserve.launch.router_address import adopt_router_address, given_launch_flags, http_url
from fleetserve.launch.router_check import check_router_args


def _die_with_launch(launch_pid: int):
    """A ``preexec_fn``: the child gets SIGTERM when this launch process dies, however it dies
    (SIGKILL included, where no clean-up here runs); SIGTERM lets an instance stop its own ranks."""
    from fleetserve.engine.parent_watch import set_parent_death_signal

    return lambda: set_parent_death_signal(signal.SIGTERM, launch_pid)


@dataclass
class Child:
    """One started process (router or instance)."""

    name: str
    cmd: list[str]
    url: str
    proc: subprocess.Popen | None = None
    log: Path | None = None
    restarts: int = 0
    pending_since: float | None = None  # restarted, waiting to be healthy before re-registering
    output: threading.Thread | None = None  # copies the child's output (see launch.output)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(),
                                     preexec_fn=_die_with_launch(os.getpid()))
        self.output = start_copy(self.name, self.proc.stdout, self.log)
        say(f"[launch] started {self.name} pid={self.proc.pid} {self.url}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # pgid == pid under start_new_session
        except (ProcessLookupError, PermissionError):
            pass


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="fleetserve launch", description="Start a router plus N engine instances; unknown flags go to every "
        "instance.", formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--workers", type=int, default=2, help="number of engine instances")
    p.add_argument("--host", default="127.0.0.1", help="address of the router and the instances")
    p.add_argument("--port", type=int, default=30000, help="router port (1..65535; 0: a free port picked by the "
                   "OS, printed)")
    p.add_argument("--worker-base-port", type=int, default=31000, help="instance i listens on this + i")
    p.add_argument("--policy", default="cache_aware", choices=("cache_aware", "round_robin", "random", "power_of_two", "kv_aware"),
                   help="the router's routing policy (fleetserve router --policy; kv_aware also gets the model's "
                        "tokenizer)")
    p.add_argument("--router-args", default="", help='extra router flags, one string: "--cache-threshold 0.5"')
    p.add_argument("--worker-kind", choices=("engine", "sim"), default="engine",
                   help="engine: fleetserve serve; sim: fleetserve sim-worker (simulated, see bench docs)")
    p.add_argument("--restart-workers", action="store_true", help="restart a dead instance and re-register it")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for all to be healthy")
    p.add_argument("--shutdown-grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--log-dir", default=None, help="also write each child's output, unprefixed, to "
                   "<log-dir>/<name>.log (appended); every line still comes to this terminal as [name] ...")
    p.add_argument("--skip-memory-check", action="store_true", help="start even if the instances' estimated "
                   "memory (weights + KV pool + overhead, see launch/memory.py) exceeds MemAvailable")
    p.add_argument("--access-log", action="store_true", help="let instances log one line per HTTP request "
                   "(uvicorn's access log; health checks included); off by default")
    return p


def pick_router_port(host: str, avoid: range) -> int:
    """A port free on ``host`` now, chosen by the OS (bind to port 0), outside ``avoid`` (the
    instances' ports). It is let go before the router binds it, so another program could take
    it in between; the router then fails with one line and the launch stops."""
    from fleetserve.entrypoints.ports import bind_socket

    for _ in range(20):
        with bind_socket(host, 0) as s:
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError(f"no free port outside {avoid.start}..{avoid.stop - 1}")


_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")  # the router's rule for a worker URL's host


def host_error(host: str) -> str | None:
    """One line naming ``--host`` when it cannot go into the instances' and the router's URLs, else None."""
    if not host:
        return "--host '': no host"
    if ":" in host:
        return f"--host {host!r}: launch takes a host name or an IPv4 address, not an IPv6 address"
    if not _HOST_NAME.match(host):
        return f"--host {host!r}: {host!r} is not a host name or IP address"
    return None


def check_ports(args: argparse.Namespace) -> str | None:
    """One line naming the flag when the router's or an instance's port is out of range, taken twice, or busy.

    Checked before any child starts, so a bad port never costs a model load.
    """
    from fleetserve.entrypoints.ports import port_busy_error, port_range_error

    flag, host = getattr(args, "router_port_flag", "--port"), getattr(args, "router_host", args.host)
    bad = port_range_error(flag, args.port, allow_zero=True)  # 0 is resolved in main()
    if bad:
        return bad
    bad = port_range_error("--worker-base-port", args.worker_base_port, args.workers)
    if bad:
        return f"{bad} (--workers {args.workers})"
    workers = range(args.worker_base_port, args.worker_base_port + args.workers)
    if args.port in workers:
        return (f"{flag} {args.port} is also an instance's port (--worker-base-port {args.worker_base_port} "
                f".. {workers[-1]})")
    for flag, h, port in [(flag, host, args.port), *(("--worker-base-port", args.host, p) for p in workers)]:
        busy = port_busy_error(flag, h, port)
        if busy:
            return busy
    return None


def access_log_flags(args: argparse.Namespace) -> list[str]:
    """The instance flags that give ``--access-log``'s choice: ``serve`` logs each request
    unless told ``--disable-uvicorn-access-log`` (vLLM's flag); ``sim-worker`` logs none
    unless told ``--access-log``."""
    if args.worker_kind == "engine":
        return [] if args.access_log else ["--disable-uvicorn-access-log"]
    return ["--access-log"] if args.access_log else []


def time_flag_error(args: argparse.Namespace) -> str | None:
    """One line for a ``--startup-timeout`` that is not > 0 or a ``--shutdown-grace`` below 0 (None if both fit)."""
    if not args.startup_timeout > 0:
        return f"--startup-timeout must be > 0 seconds, got {args.startup_timeout:g}"
    if not args.shutdown_grace >= 0:
        return f"--shutdown-grace must be >= 0 seconds, got {args.shutdown_grace:g}"
    return None


def log_dir_error(args: argparse.Namespace) -> str | None:
    """One line when ``--log-dir`` cannot be made a writable folder (None if it can, or was not given);
    the folder is created here, before any instance starts."""
    if not args.log_dir:
        return None
    path = Path(args.log_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--log-dir {args.log_dir}: cannot create it: {e.strerror or e}"
    if not os.access(path, os.W_OK):
        return f"--log-dir {args.log_dir}: not writable"
    return None


def router_args_conflict(args: argparse.Namespace, argv: list[str]) -> str | None:
    """One line when ``--router-args`` takes what launch decides (None when they agree): launch registers
    its own instances as the workers, so a ``--worker-urls`` there would replace them (and the router
    would wait for workers launch knows nothing of); a ``--policy`` there that differs from launch's
    own ``--policy``, given too, leaves no telling which was meant (launch sets the instances up for
    its policy: KV events and the tokenizer for kv_aware)."""
    extra = shlex.split(args.router_args)
    if _flag_value(extra, "--worker-urls") is not None or any(t.startswith("--worker-urls") for t in extra):
        return ("--router-args --worker-urls: launch registers its own instances with the router; add other "
                "workers once it runs (POST /add_worker?url=...), or start `fleetserve router` by itself")
    theirs, ours = _flag_value(extra, "--policy"), _flag_value(argv, "--policy")
    if theirs is not None and ours is not None and theirs != ours:
        return f"--policy {ours} and --router-args --policy {theirs} differ: give the policy once"
    return None


def effective_policy(args: argparse.Namespace) -> str:
    """The routing policy the router will run: a ``--policy`` inside ``--router-args`` comes
    after launch's own on the router's command line, so it wins (argparse keeps the last)."""
    policy = args.policy
    extra = shlex.split(args.router_args)
    for i, tok in enumerate(extra):
        if tok == "--policy" and i + 1 < len(extra):
            policy = extra[i + 1]
        elif tok.startswith("--policy="):
            policy = tok.split("=", 1)[1]
    return policy


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given to ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``), else None."""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def client_api_key(args: argparse.Namespace, instance_args: list[str]) -> str | None:
    """The key a client must send through the router: the router's own ``--api-key`` (in
    ``--router-args``) when set, else the instances' ``--api-key`` (the router forwards the
    client's ``Authorization`` to them); None when neither is set."""
    return _flag_value(shlex.split(args.router_args), "--api-key") or _flag_value(instance_args, "--api-key")


def router_key_args(args: argparse.Namespace, instance_args: list[str]) -> list[str]:
    """``["--api-key", K]`` when the instances run with ``--api-key K`` and ``--router-args`` names no
    key of its own: the router sends its ``--api-key`` to the workers on its own requests (health
    checks, kv_aware's ``/get_server_info`` and ``/v1/loads``), as sglang-router does, so without it
    a keyed fleet's router could not read its workers. Clients already need K (the instances check it)."""
    if _flag_value(shlex.split(args.router_args), "--api-key") is not None:
        return []
    key = _flag_value(instance_args, "--api-key")
    return ["--api-key", key] if key else []


def curl_example(url: str, key: str | None) -> str:
    """The greedy chat request ``launch`` prints once the router is ready (with the key when one is needed)."""
    auth = f" -H 'Authorization: Bearer {key}'" if key else ""
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{EXAMPLE_BODY}'"


def router_tokenizer_args(args: argparse.Namespace, instance_args: list[str]) -> list[str]:
    """``["--tokenizer-path", DIR]`` for a kv_aware router, unless given in --router-args.

    In front of engines DIR is the instances' ``--tokenizer-path`` / ``--model-path`` (a directory),
    or for a GGUF (the built-in model too) the tokenizer directory the engine converts it to (made
    here if needed). In front of sim workers run with ``--tokenizer smollm2`` it is the built-in
    model's tokenizer (theirs); sims with their default ``word`` tokenizer get none: no router-side
    tokenizer can give their ids, so kv_aware routes them on the text (``reason=text``).
    """
    if effective_policy(args) != "kv_aware":
        return []
    if _flag_value(shlex.split(args.router_args), "--tokenizer-path") is not None:
        return []
    from fleetserve.models.tokenizer import tokenizer_dir

    if args.worker_kind != "engine":
        return ["--tokenizer-path", tokenizer_dir(None)] if _flag_value(instance_args, "--tokenizer") == "smollm2" else []
    path = (_flag_value(instance_args, "--tokenizer-path") or _flag_value(instance_args, "--model-path")
            or _flag_value(instance_args, "--model"))
    return ["--tokenizer-path", tokenizer_dir(path)]


def _without_address(tokens: list[str]) -> list[str]:
    """``tokens`` less their ``--host`` / ``--port`` flags (``--port 8`` and ``--port=8``)."""
    out, skip = [], False
    for t in tokens:
        if skip:
            skip = False
        elif t in ("--host", "--port"):
            skip = True
        elif not t.startswith(("--host=", "--port=")):
            out.append(t)
    return out


def router_argv(args: argparse.Namespace, instance_args: list[str]) -> list[str]:
    """The router's flags (after ``fleetserve router``): launch's own, then ``--router-args`` (which win).

    Before the router's address is settled (``launch/router_address.py``) the ``--router-args``
    come last as given, so the router's parser picks the address they name.  Once it is settled,
    ``--host`` / ``--port`` appear once, with the settled values, and are dropped from the
    ``--router-args`` (a ``--router-args --port 0`` so gives way to the port picked for it)."""
    urls = [f"http://{args.host}:{args.worker_base_port + i}" for i in range(args.workers)]
    extra = shlex.split(args.router_args)
    if getattr(args, "router_address_set", False):
        address, extra = ["--host", args.router_host, "--port", str(args.port)], _without_address(extra)
    else:
        address = ["--host", args.host, "--port", str(args.port)]
    # the router's own wait for its requests in flight, within launch's (shutdown); --router-args win
    grace = ["--shutdown-grace-period-secs", f"{args.shutdown_grace:g}"]
    return [*address, "--policy", args.policy, "--worker-urls", *urls, *grace,
            *router_tokenizer_args(args, instance_args), *router_key_args(args, instance_args), *extra]


# The example printed once the fleet is up: greedy (temperature 0) so that the first answer
# shows the model at its best; the line after it says how to sample.
EXAMPLE_BODY = ('{"messages":[{"role":"user","content":"What is the capital of France?"}],'
                '"max_tokens":32,"temperature":0}')


# seconds between the "still waiting" lines while instances start
PROGRESS_EVERY_S = 15.0
# shutdown: the router's time to exit after its grace period (router_argv gives it --shutdown-grace), and
# the least time the instances get after the router is gone
ROUTER_EXIT_S = 3.0
INSTANCE_STOP_S = 5.0


def progress(line: str) -> None:
    """One start-up progress line, ``[launch] ...``, on stderr (the children's lines and the
    results stay on stdout)."""
    say(f"[launch] {line}", err=True)


def _http(url: str, method: str = "GET", timeout: float = 2.0, key: str | None = None) -> int:
    """Status code of a bodiless request (with ``Authorization: Bearer key`` when a key is given),
    0 when unreachable."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return 0


class Launcher:
    """Owns the children; see the module docstring for the life cycle."""

    def __init__(self, args: argparse.Namespace, instance_args: list[str]):
        self.args = args
        self.client_key = client_api_key(args, instance_args)
        self.stopping = False
        log_dir = Path(args.log_dir) if args.log_dir else None
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
        py = [sys.executable, "-m", "fleetserve.cli"]
        sub = "serve" if args.worker_kind == "engine" else "sim-worker"
        self.workers = []
        for i in range(args.workers):
            port = args.worker_base_port + i
            own = instance_kv_events_args(instance_args, i)  # its own KV-event ports (launch/kv_ports.py)
            cmd = py + [sub, *own, *access_log_flags(args), "--host", args.host, "--port", str(port)]
            self.workers.append(Child(f"worker{i}", cmd, f"http://{args.host}:{port}",
                                      log=log_dir / f"worker{i}.log" if log_dir else None))
        self.router_url = http_url(getattr(args, "router_host", args.host), args.port)
        rcmd = py + ["router", *router_argv(args, instance_args)]
        self.router = Child("router", rcmd, self.router_url, log=log_dir / "router.log" if log_dir else None)

    # ---------------------------------------------------------------- helpers
    def _on_signal(self, signum, _frame) -> None:
        if self.stopping:  # a second signal: the router stops waiting for its requests in flight (router/cli.py)
            if self.router is not None and self.router.alive():
                say(f"[launch] {signal.Signals(signum).name} again: the router ends its wait for the requests "
                    "in flight now")
                self.router.signal_group(signal.SIGTERM)
            else:
                say(f"[launch] {signal.Signals(signum).name} again: already stopping")
            return
        say(f"[launch] {signal.Signals(signum).name}: stopping")
        self.stopping = True

    def _wait_healthy(self, children: list[Child], deadline: float) -> bool:
        waiting = list(children)
        began = time.monotonic()
        next_note = began + PROGRESS_EVERY_S
        while waiting:
            if self.stopping:
                return False
            for c in list(waiting):
                if not c.alive():
                    say(f"[launch] {c.name} exited with code {c.proc.returncode} during start-up")
                    return False
                if _http(c.url + "/health") == 200:
                    say(f"[launch] {c.name} healthy at {c.url}")
                    waiting.remove(c)
            now = time.monotonic()
            if waiting and now >= next_note:  # no long silence while models load
                progress(f"still waiting for {', '.join(c.name for c in waiting)} to answer /health "
                         f"({now - began:.0f} s; --startup-timeout {self.args.startup_timeout:g})")
                next_note = now + PROGRESS_EVERY_S
            if time.monotonic() > deadline:
                say(f"[launch] not healthy within {self.args.startup_timeout} s: "
                    f"{', '.join(c.name for c in waiting)}")
                return False
            time.sleep(0.25)
        return True

    def shutdown(self) -> None:
        """Stop the router first, then the instances: the router stops taking requests and lets those
        in flight finish (its ``--shutdown-grace-period-secs``) while the instances still serve them;
        each stage has until ``--shutdown-grace`` seconds from now, the instances at least
        :data:`INSTANCE_STOP_S`.  (Signalled together, the instances ended their streams at once with
        ``engine_unavailable``, so the router's grace period never applied.)"""
        deadline = time.monotonic() + self.args.shutdown_grace
        self._stop([self.router], deadline + ROUTER_EXIT_S)  # its own grace period is --shutdown-grace
        self._stop(self.workers, max(deadline, time.monotonic() + INSTANCE_STOP_S))
        say("[launch] all processes stopped")

    def _stop(self, children: list, deadline: float) -> None:
        """SIGTERM each of ``children``'s process groups, wait until ``deadline``, SIGKILL what is left."""
        for c in children:
            c.signal_group(signal.SIGTERM)
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"[launch] {c.name} did not stop within {self.args.shutdown_grace} s: SIGKILL")
            c.signal_group(signal.SIGKILL)  # also reaps grandchildren left in the group
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
            if c.output is not None:
                c.output.join(timeout=5)  # its last lines (a grandchild may still hold the pipe: bounded)

    def _watch_workers(self) -> None:
        for w in self.workers:
            if w.pending_since is not None:
                if not w.alive():
                    w.pending_since = None  # died again during restart: handled below
                elif _http(w.url + "/health") == 200:
                    status = _http(f"{self.router_url}/add_worker?url={w.url}", "POST", timeout=30,
                                   key=self.client_key)
                    say(f"[launch] {w.name} back: re-registered with the router (status {status})")
                    w.pending_since = None
                    continue
                else:
                    continue
            if w.alive():
                continue
            say(f"[launch] {w.name} (pid {w.proc.pid}) exited with code {w.proc.returncode}")
            w.signal_group(signal.SIGKILL)  # its scheduler processes, if any are left
            _http(f"{self.router_url}/remove_worker?url={w.url}", "POST", timeout=10, key=self.client_key)
            if self.args.restart_workers:
                w.restarts += 1
                w.start()
                w.pending_since = time.monotonic()
            else:
                w.proc = None  # stop watching it
                self.workers = [x for x in self.workers if x is not w]
                if not self.workers:  # the router stays up (workers can be added), but say what that means
                    say("[launch] no instance left: the router answers 503 (no_healthy_worker) until one is added "
                        "(POST /add_worker or /workers); --restart-workers restarts dead instances")

    # ------------------------------------------------------------------- run
    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal went away
            signal.signal(sig, self._on_signal)
        code = 0
        try:
            for w in self.workers:
                w.start()
            what = "loading the model" if self.args.worker_kind == "engine" else "starting"
            progress(f"{len(self.workers)} instance(s) {what}; each is ready when it answers /health")
            deadline = time.monotonic() + self.args.startup_timeout
            # (a signal during the last health check ends the wait with True: no router is started then)
            if not self._wait_healthy(self.workers, deadline) or self.stopping:
                return 0 if self.stopping else 1
            self.router.start()
            progress(f"router: waiting for its {len(self.workers)} workers' health checks")
            if not self._wait_healthy([self.router], deadline):
                return 0 if self.stopping else 1
            say(f"[launch] router ready: {self.router_url} ({effective_policy(self.args)}, "
                f"{len(self.workers)} instances)\n"
                f"[launch] try: {curl_example(self.router_url, self.client_key)}\n"
                f"[launch] (greedy; set \"temperature\" above 0, e.g. 0.7, to sample)")
            while not self.stopping:
                time.sleep(0.5)
                if self.stopping:  # a signal: a router that a second one already stopped is no failure
                    break
                if not self.router.alive():
                    say(f"[launch] router exited with code {self.router.proc.returncode}; stopping")
                    code = 1
                    break
                self._watch_workers()
            return code
        finally:
            self.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``fleetserve launch``; every line it queued for the terminal is written (bounded wait,
    :func:`.output.drain`) before it returns."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C during the checks, before the launcher's own handlers are set
        say("[launch] interrupted before any instance started", err=True)
        return 130
    finally:
        drain()


def _main(argv: list[str] | None = None) -> int:
    from fleetserve.entrypoints.ports import port_range_error

    argv = list(sys.argv[1:] if argv is None else argv)
    args, instance_args = build_parser().parse_known_args(argv)
    if args.workers < 1:
        say(f"fleetserve launch: --workers must be >= 1, got {args.workers}", err=True)
        return 2
    bad = port_range_error("--port", args.port, allow_zero=True) or time_flag_error(args) or log_dir_error(args)
    if not bad and port_range_error("--worker-base-port", args.worker_base_port, args.workers):
        # launch's own flag, named before the router's check sees the worker URLs made from it
        bad = f"{port_range_error('--worker-base-port', args.worker_base_port, args.workers)} (--workers {args.workers})"
    if not bad:  # the instances' and the router's URLs are made from --host: a bad one is launch's flag
        bad = host_error(args.host)
    try:
        shlex.split(args.router_args)
    except ValueError as e:  # e.g. an unclosed quote
        bad = bad or f"--router-args: {e}: {args.router_args!r}"
    router = {}
    bad = bad or router_args_conflict(args, argv)
    if not bad:  # the router's own flag checks, in a child process that starts nothing (launch/router_check.py)
        bad, router = check_router_args(router_argv(args, instance_args))
    if not bad:  # where the router will listen: launch's --host/--port or those in --router-args
        bad = adopt_router_address(args, router, given_launch_flags(build_parser(), argv))
    if not bad and args.port == 0 and port_range_error("--worker-base-port", args.worker_base_port,
                                                       args.workers) is None:
        try:
            args.port = pick_router_port(args.router_host,
                                         range(args.worker_base_port, args.worker_base_port + args.workers))
        except OSError as e:
            say(f"fleetserve launch: {args.router_port_flag} 0: cannot pick a free port on {args.router_host}: "
                f"{e.strerror or e}", err=True)
            return 2
        say(f"[launch] {args.router_port_flag} 0: the router will listen on port {args.port}")
    if not bad and effective_policy(args) == "kv_aware" and not kv_events_given(instance_args):
        # a kv_aware router routes on the instances' KV events: without a publisher it has only its tree
        taken = {args.port, *range(args.worker_base_port, args.worker_base_port + args.workers)}
        if router.get("prometheus_port"):
            taken.add(router["prometheus_port"])
        cfg = default_kv_events_config(instance_args, args.workers, taken)
        if cfg is None:
            say("[launch] warning: --policy kv_aware: no free port range for the instances' KV events "
                "from 5557 up; pass --kv-events-config (routed on the approximate tree until then)")
        else:
            instance_args = [*instance_args, "--kv-events-config", cfg]
            say(f"[launch] --policy kv_aware: the instances publish KV-cache events (--kv-events-config {cfg}, "
                "instance i on the port + i x DP size; pass your own --kv-events-config to change it)")
    bad = bad or check_ports(args) or check_kv_event_ports(instance_args, args.workers)
    for line in router.get("warnings", ()):  # the router logs them too, once it starts
        say(f"[launch] warning: --router-args: {line}")
    if not bad:
        metrics = (router["prometheus_host"], router["prometheus_port"]) if router.get("prometheus_port") else None
        ports = plan(args.host, args.port, args.worker_base_port, args.workers, instance_args, prometheus=metrics,
                     router_host=args.router_host, router_flag=args.router_port_flag)
        bad = first_collision(ports) or first_busy(ports)
    if bad:
        say(f"fleetserve launch: {bad}", err=True)
        return 2
    from fleetserve.launch.memory import check_launch

    bad, note = check_launch(args, instance_args)
    if note:
        say(f"[launch] {note}")
    if bad:
        say(f"fleetserve launch: {bad}", err=True)
        return 2
    return Launcher(args, instance_args).run()


if __name__ == "__main__":
    sys.exit(main())
