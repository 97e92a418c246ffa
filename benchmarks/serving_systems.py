"""Serving systems side by side over HTTP: ``fleetserve serve`` per ``--quantization`` and llama.cpp's server.

Used by ``benchmarks/engine_throughput.py --only-systems`` (and its full run). Each
system is a real server process on a free port, driven by the same client
(:func:`fleetserve.bench.client.run_requests`, streaming ``/v1/completions``,
greedy, ``ignore_eos`` so each request gets exactly its ``max_tokens``) with a
closed loop of ``c`` requests in flight. transformers has no server; the caller
measures it in-process.

* :func:`fleetserve_server`: ``python -m fleetserve serve --quantization Q
  --torch-num-threads T``, one rank.
* :func:`llama_server`: llama.cpp's ``llama-server`` binary on the same GGUF,
  ``-t T -tb T --parallel N -c N * ctx_per_slot`` (continuous batching is on by
  default in llama-server), or ``None`` when the binary is not given or missing.
* :func:`measure`: output tok/s (sum of ``completion_tokens`` over the run's
  duration, first send -> last response) and mean TTFT (send -> first text chunk).
* :func:`cpu_description`: the CPU model and the SIMD flags that matter here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


@dataclass
class Server:
    """A running server: its display name, base URL, process and log file path."""

    name: str
    base: str
    proc: subprocess.Popen
    log_path: str
    version: str = ""


def _free_port() -> int:
    from fleetserve.engine.rank_supervisor import free_port

    return free_port()


def _wait_healthy(proc: subprocess.Popen, base: str, log_path: str, timeout_s: float) -> None:
    """Poll ``base/health`` until 200; ``RuntimeError`` with the log's tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"{base}: server exited with {proc.returncode}:\n{f.read()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base}: not healthy after {timeout_s:.0f} s (log: {log_path})")
        time.sleep(0.5)


def _start(name: str, cmd: list[str], port: int, timeout_s: float, env: dict | None = None,
           wait: bool = True) -> Server:
    fd, log_path = tempfile.mkstemp(prefix=f"bench-{name.replace(' ', '_')}-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(name, f"http://127.0.0.1:{port}", proc, log_path)
    if wait:
        wait_ready(srv, timeout_s)
    return srv


def wait_ready(srv: Server, timeout_s: float = 600) -> None:
    """Wait for ``srv``'s ``/health``; on failure stop it and raise ``RuntimeError`` (with its log's tail)."""
    try:
        _wait_healthy(srv.proc, srv.base, srv.log_path, timeout_s)
    except BaseException:
        stop(srv)
        raise


def stop(server: Server) -> None:
    """SIGTERM the server's session, SIGKILL after 15 s."""
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(5)


def fleetserve_server(model_path: str, quantization: str, threads: int, timeout_s: float = 600,
                      wait: bool = True, src: str | None = None, name: str | None = None,
                      extra_args: list[str] | tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> Server:
    """``fleetserve serve`` with ``--quantization quantization --torch-num-threads threads`` (one rank).

    ``extra_args``: more ``fleetserve serve`` flags (e.g. ``--enable-torch-compile``).
    ``wait=False``: return at once (call :func:`wait_ready` later), so several start together.
    ``src``: the ``src`` folder to run fleetserve from (default: this checkout's), e.g. an older
    revision's for an A/B run; ``name``: the server's display name; ``extra_env``: more environment
    variables for the server (e.g. ``TORCHINDUCTOR_CPP_WRAPPER=1``)."""
    port = _free_port()
    src = src or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {}))
    cmd = [sys.executable, "-m", "fleetserve.cli", "serve", "--model-path", model_path, "--host", "127.0.0.1",
           "--port", str(port), "--quantization", quantization, "--torch-num-threads", str(threads),
           "--random-seed", "0", "--disable-uvicorn-access-log", "--log-level", "warning", *extra_args]
    return _start(name or f"fleetserve {quantization}", cmd, port, timeout_s, env, wait)


def llama_server_version(binary: str) -> str:
    """What ``llama-server --version`` prints (its ``version: N (commit)`` line), or ``"unknown"``."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "unknown"


def llama_server(binary: str | None, gguf: str, threads: int, parallel: int, ctx_per_slot: int,
                 timeout_s: float = 300) -> Server | None:
    """llama.cpp's ``llama-server`` on ``gguf`` with ``parallel`` slots; ``None`` if ``binary`` is unset/missing."""
    if not binary or not os.path.isfile(binary) or not os.access(binary, os.X_OK):
        return None
    port = _free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--no-webui", "--log-disable"]
    srv = _start("llama.cpp", cmd, port, timeout_s)
    srv.version = llama_server_version(binary)
    return srv


#: resends per request after a try that got no byte of a response (see :func:`measure`)
RETRIES = 2


@dataclass
class Result:
    """One system at one level: output tokens/s, mean TTFT (s), requests, output tokens, failures,
    and retries (requests sent again after a try that got no byte of a response)."""

    tps: float
    ttft: float
    requests: int
    tokens: int
    failed: int
    retries: int = 0


def measure(base: str, prompts: list[str], max_tokens: list[int], conc: int, tag: str) -> Result:
    """Closed loop of ``conc`` streaming greedy ``/v1/completions`` requests (``ignore_eos``) to ``base``.

    Raises ``RuntimeError`` when a request fails or returns other than its ``max_tokens``
    (so a system that stops early or ignores ``ignore_eos`` cannot look fast). A try that failed
    before any byte of a response came back (llama-server once closed a kept-alive connection under
    the client: "Can not write request body") is sent again, at most ``RETRIES`` times per request;
    the retries are counted in the result (and the table), never hidden.
    """
    from fleetserve.bench.client import run_requests
    from fleetserve.bench.workloads import BenchRequest

    reqs = [BenchRequest(rid=f"{tag}-{i}", messages=[{"role": "user", "content": p}], prompt_len=len(p.split()),
                         output_len=n, group=f"{tag}-{i}") for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    results, duration = asyncio.run(run_requests(base, reqs, api="completions", max_concurrency=conc,
                                                 progress=False, timeout_s=1800, retries=RETRIES))
    bad = [r for r, q in zip(results, reqs) if not r.success or r.completion_tokens != q.output_len]
    if bad:
        r = bad[0]
        raise RuntimeError(f"{base}: {len(bad)} of {len(results)} requests failed or short, e.g. {r.rid}: "
                           f"status {r.status}, {r.completion_tokens} tokens, {r.error[:300]}")
    tokens = sum(r.completion_tokens for r in results)
    return Result(tokens / duration, statistics.mean(r.ttft for r in results), len(results), tokens, 0,
                  sum(r.retries for r in results))


def cpu_description() -> tuple[str, list[str]]:
    """(CPU model name from /proc/cpuinfo or ``platform.processor()``, the :data:`SIMD_FLAGS` it has)."""
    model = platform.processor() or "unknown"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("unknown", "", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, [f for f in SIMD_FLAGS if f in flags]


def llama_batched(binary: str | None, gguf: str, threads: int, prompts: list[str], max_tokens: list[int],
                  conc: int, ctx_per_slot: int, timeout_s: float = 1800) -> Result | None:
    """The same closed loop through ``benchmarks/llamacpp_batched.cpp`` (libllama, no HTTP); ``None`` without it.

    Raises ``RuntimeError`` when the driver fails or returns other than ``sum(max_tokens)`` tokens.
    """
    import json

    if not binary or not os.path.isfile(binary) or not os.access(binary, os.X_OK):
        return None
    lines = "".join(f"{n}\t{p.replace(chr(9), ' ').replace(chr(10), ' ')}\n" for p, n in zip(prompts, max_tokens))
    out = subprocess.run([binary, gguf, str(threads), str(conc), str(ctx_per_slot)], input=lines,
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{binary} exited with {out.returncode}: {out.stderr[-500:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    if d["tokens"] != sum(max_tokens):
        raise RuntimeError(f"{binary}: {d['tokens']} tokens, expected {sum(max_tokens)}")
    return Result(d["tokens"] / d["seconds"], d["ttft_mean_s"], d["requests"], d["tokens"], 0)
