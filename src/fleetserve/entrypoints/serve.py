"""``fleetserve serve``: start one engine instance behind the HTTP API.

Steps:

1. parse :class:`~fleetserve.engine.args.ServerArgs` (SGLang flag names) plus the
   HTTP-only ``--max-request-bytes``;
2. pick two ZMQ ``ipc://`` endpoints in a private temporary directory and start
   the rank process(es) (:mod:`fleetserve.engine.rank_launch`), which load the
   model and connect to them;
3. load the tokenizer here meanwhile, then wait for every scheduler's ready
   message (it carries the vocabulary size, context limit and EOS ids), failing
   fast if a child dies or ``--startup-timeout`` passes;
4. run uvicorn on ``--host``/``--port`` until SIGINT/SIGTERM;
5. always terminate the children on the way out (then kill after a grace period).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from fleetserve.entrypoints.cli_parser import OneLineParser
from fleetserve.engine.args import ServerArgs

logger = logging.getLogger("fleetserve.serve")


def build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """``fleetserve serve``'s flags; ``exit_on_error=False``: a bad value raises ``argparse.ArgumentError``."""
    p = OneLineParser(prog="fleetserve serve", description="Run one engine instance (OpenAI-compatible API).",
                                exit_on_error=exit_on_error)
    ServerArgs.add_cli_args(p)
    g = p.add_argument_group("http server")
    g.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="larger request bodies are answered with 413 (default 8 MiB)")
    g.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for the scheduler process(es) to load the model")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line per HTTP request (vLLM's flag; fleetserve launch sets it unless --access-log)")
    return p


def default_served_name(model_path: str) -> str:
    """``/x/SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.Q4_1``; directories keep their name."""
    base = os.path.basename(model_path.rstrip("/"))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def _start_schedulers(args: ServerArgs, input_ep: str, output_ep: str):
    """Start the rank process(es); returns (processes, ready readers).

    One process per rank, each sending a handshake; with several ranks also a DP
    relay thread here (:func:`fleetserve.engine.rank_launch.launch_ranks`).
    """
    from fleetserve.engine.rank_launch import launch_ranks

    instance = launch_ranks(args, input_ep, output_ep)
    return instance.procs, instance.readers


def _wait_ready(procs, readers, timeout: float) -> list[dict[str, Any]]:
    """Wait for one ready dict per reader; raise RuntimeError if a child dies or time runs out."""
    deadline = time.monotonic() + timeout
    infos: list[dict[str, Any] | None] = [None] * len(readers)
    while any(i is None for i in infos):
        for k, r in enumerate(readers):
            if infos[k] is None and r.poll(0.2):
                msg = r.recv()
                if isinstance(msg, dict) and msg.get("status") == "error":
                    raise RuntimeError(f"scheduler failed to start: {msg.get('error')}")
                infos[k] = msg if isinstance(msg, dict) else {}
        dead = [p for p in procs if not p.is_alive()]
        if dead and any(i is None for i in infos):
            raise RuntimeError(f"scheduler process exited with code {dead[0].exitcode} during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"schedulers not ready after {timeout:.0f} s")
    return [i or {} for i in infos]


def _stop(procs, grace: float = 5.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def describe_exit(code: int | None) -> str:
    """``-9 -> "code -9 (SIGKILL)"``: how a child process ended, for one log line."""
    if code is not None and code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


async def _exit_when_a_rank_dies(procs, tm, server, died: list, every_s: float = 0.5) -> None:
    """Stop the server (exit status 1) when a scheduler/rank process dies, say so once, and end
    the requests waiting on it at once (streams get an error event, others 503)."""
    from fleetserve.entrypoints.http.lifespan import ENGINE_DIED

    while True:
        await asyncio.sleep(every_s)
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            p = dead[0]
            logger.error("scheduler process %s (pid %s) exited with %s; stopping the server", p.name, p.pid,
                         describe_exit(p.exitcode))
            died.append(p)
            tm.fail_all(ENGINE_DIED)
            server.should_exit = True
            return


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    # uvicorn re-raises the signal it caught once it has shut down; with the default
    # SIGTERM action the process would die before stopping its scheduler children.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        print(f"fleetserve serve: {e}", file=sys.stderr)
        return 2
    from fleetserve.entrypoints.path_checks import model_path_error

    bad = model_path_error("--model-path", args.model_path) or model_path_error("--tokenizer-path", args.tokenizer_path)
    if bad:
        print(f"fleetserve serve: {bad}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.kv_events_config and args.nnodes == 1:  # a busy KV-event port fails now, not in a rank
        from fleetserve.engine.kv_events.config import parse_kv_events_config
        from fleetserve.engine.kv_events.publisher import check_endpoints

        try:
            check_endpoints(parse_kv_events_config(args.kv_events_config), range(args.dp_size))
        except ValueError as e:  # a busy or unopenable KV-event endpoint: a start-up error, as a busy --port
            print(f"fleetserve serve: {e}", file=sys.stderr)
            return 2
    if args.nnodes > 1 and args.node_rank > 0:  # this node only runs ranks; node 0 serves HTTP
        from fleetserve.engine.rank_launch import run_worker_node

        if args.model_path is None:
            from fleetserve.models.registry import default_model_path

            args.model_path = default_model_path()
        return run_worker_node(args, ns.startup_timeout)
    # Take the port before loading anything: a busy port fails in a second, not after the model load.
    from fleetserve.entrypoints.ports import bind_socket

    try:
        listen_sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"fleetserve serve: --port {args.port}: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 2  # a start-up error, as a bad flag (and as the router / launch / sim-worker)
    args.port = listen_sock.getsockname()[1]  # --port 0: the port the OS picked
    try:
        return _serve(args, ns, listen_sock)
    finally:
        listen_sock.close()


def _serve(args: ServerArgs, ns: argparse.Namespace, listen_sock) -> int:
    if args.model_path is None:
        from fleetserve.models.registry import default_model_path

        args.model_path = default_model_path()
    ipc_dir = tempfile.mkdtemp(prefix="fleetserve-")
    input_ep = f"ipc://{ipc_dir}/scheduler_in"
    output_ep = f"ipc://{ipc_dir}/scheduler_out"
    procs: list = []
    try:
        # Bind first (the tokenizer manager owns both sockets), then start the children.
        import uvicorn

        from fleetserve.entrypoints.http import create_app
        from fleetserve.entrypoints.tokenizer_manager import ModelInfo, TokenizerManager

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        from fleetserve.models.tokenizer import load_tokenizer

        # Ctrl-C in a terminal signals the whole process group: the ranks ignore SIGINT (inherited
        # SIG_IGN survives their exec) and this process stops them, so the user sees no traceback.
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        began = time.monotonic()
        logger.info("loading %s on %d rank(s); /health answers once it is loaded", args.model_path, args.world_size)
        try:
            procs, readers = _start_schedulers(args, input_ep, output_ep)
        finally:
            signal.signal(signal.SIGINT, sigint)
        tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)  # GGUF: converted once, then cached
        infos = _wait_ready(procs, readers, ns.startup_timeout)
        logger.info("model loaded in %.0f s", time.monotonic() - began)
        first = infos[0]
        vocab = int(first.get("vocab_size") or len(tokenizer))
        ctx = int(first.get("max_context_len") or args.context_length or getattr(tokenizer, "model_max_length", 2048))
        if first.get("max_total_tokens"):  # a prompt plus its output must fit in the KV pool too
            ctx = min(ctx, int(first["max_total_tokens"]))
        info = ModelInfo(
            model_path=args.model_path,
            served_model_name=args.served_model_name or default_served_name(args.model_path),
            vocab_size=vocab,
            context_length=ctx,
            eos_token_ids=list(first.get("eos_token_ids") or []),
        )

        async def serve() -> None:
            tm = TokenizerManager(tokenizer, info, input_ep, output_ep, num_schedulers=len(procs))
            await tm.wait_connected(timeout=60.0)  # /health answers 200 only once requests can flow
            app = create_app(tm, server_args=args.to_dict(), api_key=args.api_key,
                             max_request_bytes=ns.max_request_bytes,
                             is_alive=lambda: all(p.is_alive() for p in procs))
            config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                    access_log=not ns.disable_uvicorn_access_log,
                                    timeout_keep_alive=5, h11_max_incomplete_event_size=ns.max_request_bytes + 65536)
            logger.info("serving %s on http://%s:%d (context %d tokens, vocab %d)",
                        info.served_model_name, args.host, args.port, ctx, vocab)
            server = uvicorn.Server(config)
            watch = asyncio.get_running_loop().create_task(_exit_when_a_rank_dies(procs, tm, server, died))
            try:
                await server.serve(sockets=[listen_sock])
            finally:
                watch.cancel()
                await tm.close()

        died: list = []
        loop.run_until_complete(serve())
        return 1 if died else 0
    except (RuntimeError, ValueError, NotImplementedError, FileNotFoundError) as e:
        logger.error("%s: %s", type(e).__name__, e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises the SIGINT it caught once it has shut down
        logger.info("interrupted: stopped")
        return 128 + signal.SIGINT
    finally:
        _stop(procs)
        shutil.rmtree(ipc_dir, ignore_errors=True)
