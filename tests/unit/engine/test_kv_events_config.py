"""--kv-events-config: vLLM's / SGLang's keys and defaults, per-DP-rank endpoints, one-line errors."""

import json

import pytest
import zmq

from fleetserve.bench import sim_worker
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.kv_events.config import KVEventsConfig, binds, offset_endpoint, parse_kv_events_config
from fleetserve.engine.kv_events.publisher import KVEventPublisher
from fleetserve.entrypoints import serve as launch_server
from helpers.kv_events_sub import free_port_block


def test_defaults_are_vllm_and_sglang_defaults():
    cfg = parse_kv_events_config('{"publisher": "zmq"}')
    # vllm/config/kv_events.py and sglang kv_events.py KVEventsConfig defaults
    assert cfg == KVEventsConfig(publisher="zmq", endpoint="tcp://*:5557", replay_endpoint=None, buffer_steps=10_000,
                                 hwm=100_000, max_queue_size=100_000, topic="", encoding="map")


def test_vllm_enable_switch_and_null_publisher():
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}').publisher == "zmq"
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert parse_kv_events_config('{"endpoint": "tcp://*:6000"}') is None  # SGLang: publisher defaults to null
    assert parse_kv_events_config("{}") is None
    assert parse_kv_events_config(None) is None and parse_kv_events_config("") is None
    full = {"publisher": "zmq", "endpoint": "ipc:///tmp/kv", "replay_endpoint": "tcp://*:7001", "buffer_steps": 0,
            "hwm": 0, "max_queue_size": 1, "topic": "kv@w0", "encoding": "array"}
    assert parse_kv_events_config(json.dumps(full)) == KVEventsConfig(**full)


@pytest.mark.parametrize("text, key", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"publisher": "kafka"}', "publisher:"),
    ('{"publisher": "zmq", "bogus": 1}', "bogus: unknown key"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events:"),
    ('{"publisher": "zmq", "endpoint": "tcp://*"}', "endpoint:"),
    ('{"publisher": "zmq", "endpoint": "tcp://*:70000"}', "endpoint:"),
    ('{"publisher": "zmq", "endpoint": "tcp://*:abc"}', "endpoint:"),
    ('{"publisher": "zmq", "endpoint": "udp://h:5557"}', "endpoint:"),
    ('{"publisher": "zmq", "endpoint": ""}', "endpoint:"),
    ('{"publisher": "zmq", "endpoint": 5557}', "endpoint:"),
    ('{"publisher": "zmq", "replay_endpoint": "localhost:5558"}', "replay_endpoint:"),
    ('{"publisher": "zmq", "replay_endpoint": "tcp://*:5557"}', "replay_endpoint:"),
    ('{"publisher": "zmq", "buffer_steps": -1}', "buffer_steps:"),
    ('{"publisher": "zmq", "buffer_steps": true}', "buffer_steps:"),
    ('{"publisher": "zmq", "hwm": -5}', "hwm:"),
    ('{"publisher": "zmq", "max_queue_size": 0}', "max_queue_size:"),
    ('{"publisher": "zmq", "max_queue_size": "10"}', "max_queue_size:"),
    ('{"publisher": "zmq", "topic": 5}', "topic:"),
    ('{"publisher": "zmq", "encoding": "json"}', "encoding:"),
])
def test_bad_config_is_one_line_naming_the_key(text, key):
    with pytest.raises(ValueError) as e:
        parse_kv_events_config(text)
    msg = str(e.value)
    assert msg.startswith("--kv-events-config: ") and key in msg and "\n" not in msg
    with pytest.raises(ValueError, match="^--kv-events-config: "):
        ServerArgs(kv_events_config=text)


def test_every_dp_rank_needs_a_port():
    cfg = '{"publisher": "zmq", "endpoint": "tcp://*:65535"}'
    ServerArgs(kv_events_config=cfg)
    with pytest.raises(ValueError, match=r"^--kv-events-config: endpoint .*DP rank 1 would use port 65536"):
        ServerArgs(kv_events_config=cfg, dp_size=2)


def test_offset_endpoint_per_dp_rank():
    # vLLM / SGLang offset_endpoint_port: tcp port + rank, inproc "_dp<rank>", rank 0 unchanged
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://10.0.0.7:5557", 1) == "tcp://10.0.0.7:5558"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_bind_or_connect_rule():
    assert binds("tcp://*:5557") and binds("tcp://0.0.0.0:5557") and binds("tcp://[::]:5557")
    assert binds("ipc:///tmp/kv") and binds("inproc://kv")
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://collector.local:5557")


def test_busy_endpoint_is_one_line_naming_it():
    port = free_port_block(1)
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://*:{port}")
    try:
        cfg = parse_kv_events_config(json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{port}"}))
        with pytest.raises(ValueError) as e:
            KVEventPublisher(cfg)
        msg = str(e.value)
        assert msg.startswith(f"--kv-events-config: endpoint 'tcp://*:{port}': cannot bind") and "\n" not in msg
        # DP rank 1 of base port - 1 lands on the busy port too
        cfg = parse_kv_events_config(json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{port - 1}"}))
        with pytest.raises(ValueError, match=f"endpoint 'tcp://\\*:{port}': cannot bind"):
            KVEventPublisher(cfg, data_parallel_rank=1)
        cfg = parse_kv_events_config(json.dumps({"publisher": "zmq", "endpoint": "inproc://ok",
                                                 "replay_endpoint": f"tcp://*:{port}"}))
        with pytest.raises(ValueError, match=f"^--kv-events-config: replay_endpoint 'tcp://\\*:{port}': cannot bind"):
            KVEventPublisher(cfg)
    finally:
        holder.close(0)
        ctx.term()


def test_serve_cli_refuses_bad_config_before_starting(capsys):
    assert launch_server.main(["--kv-events-config", '{"publisher": "zmq", "hwm": -1}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fleetserve serve: --kv-events-config: hwm: must be >= 0, got -1"]


def test_serve_parser_takes_the_flag():
    ns = launch_server.build_parser().parse_args(["--kv-events-config", '{"publisher": "zmq"}'])
    assert ServerArgs.from_cli_args(ns).kv_events_config == '{"publisher": "zmq"}'


def test_sim_worker_refuses_bad_config(capsys):
    assert sim_worker.main(["--port", "0", "--kv-events-config", '{"publisher": "zmq", "topic": 1}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sim-worker: --kv-events-config: topic: must be a string, got 1"]


def test_serve_cli_refuses_a_busy_kv_event_port_of_any_dp_rank(capsys):
    base = free_port_block(2)
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://*:{base + 1}")  # DP rank 1's port
    try:
        cfg = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{base}"})
        assert launch_server.main(["--port", "0", "--dp-size", "2", "--kv-events-config", cfg]) == 2  # as a busy --port
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"fleetserve serve: --kv-events-config: endpoint 'tcp://*:{base + 1}': cannot bind "
                       "(Address already in use)"]
    finally:
        holder.close(0)
        ctx.term()
    # free again: the check released DP rank 0's port (the ranks bind it next)
    KVEventPublisher(parse_kv_events_config(cfg), 0, autostart=False).shutdown()
