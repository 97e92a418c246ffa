import os

from fleetserve.entrypoints import serve as launch_server
from fleetserve.models import tokenizer


def test_bad_flag_value_exits_2_without_starting(capsys):
    assert launch_server.main(["--tp-size", "0"]) == 2
    assert "--tp-size" in capsys.readouterr().err


def test_missing_model_or_tokenizer_path_is_one_line_naming_the_flag(tmp_path, capsys):
    assert launch_server.main(["--model-path", str(tmp_path / "nope"), "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == f"fleetserve serve: --model-path {tmp_path / 'nope'}: no such file or directory"
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    assert launch_server.main(["--model-path", str(f), "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == (f"fleetserve serve: --model-path {f}: give a model directory "
                                               "or a .gguf file")
    assert launch_server.main(["--model-path", str(tmp_path), "--tokenizer-path", "/no/tok", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == "fleetserve serve: --tokenizer-path /no/tok: no such file or directory"


def test_parser_has_sglang_names():
    ns = launch_server.build_parser().parse_args([
        "--model", "/m", "--host", "0.0.0.0", "--port", "1234", "--max-total-tokens", "99",
        "--max-running-requests", "7", "--chunked-prefill-size", "-1", "--schedule-policy", "fcfs",
        "--disable-radix-cache", "--served-model-name", "x", "--api-key", "k", "--max-request-bytes", "10"])
    assert (ns.model_path, ns.host, ns.port, ns.max_total_tokens, ns.max_running_requests) == ("/m", "0.0.0.0", 1234, 99, 7)
    assert (ns.chunked_prefill_size, ns.schedule_policy, ns.disable_radix_cache) == (-1, "fcfs", True)
    assert (ns.served_model_name, ns.api_key, ns.max_request_bytes) == ("x", "k", 10)


def test_served_name_and_tokenizer_cache_key(tmp_path, monkeypatch, caplog):
    assert launch_server.default_served_name("/a/b/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    assert launch_server.default_served_name("/models/llama/") == "llama"
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    monkeypatch.setenv("FLEETSERVE_CACHE", str(tmp_path / "cache"))
    d1 = tokenizer.tokenizer_cache_dir(str(f))
    assert d1.startswith(str(tmp_path / "cache" / "tokenizers"))
    f.write_bytes(b"xy")  # a changed file gets a new key
    assert tokenizer.tokenizer_cache_dir(str(f)) != d1

    class Tok:
        def save_pretrained(self, d):
            open(os.path.join(d, "tokenizer_config.json"), "w").write("{}")

    tokenizer.save_tokenizer_cache(Tok(), d1)
    assert os.path.isfile(os.path.join(d1, "tokenizer_config.json"))
    with caplog.at_level("WARNING", logger="fleetserve.models.tokenizer"):
        tokenizer.save_tokenizer_cache(Tok(), d1)  # second save (two instances racing): no warning, no leftovers
    assert [r.getMessage() for r in caplog.records] == []
    assert [n for n in os.listdir(os.path.dirname(d1)) if n.startswith(".tmp-")] == []
    bad = str(tmp_path / "file-not-dir")
    open(bad, "w").write("x")  # a real failure (the base is a file) still warns
    with caplog.at_level("WARNING", logger="fleetserve.models.tokenizer"):
        tokenizer.save_tokenizer_cache(Tok(), os.path.join(bad, "key"))
    assert any("could not cache the tokenizer" in r.getMessage() for r in caplog.records)
