"""Router-side tokenization: the same ids as the engine's tokenizer (transformers), without torch."""

import logging
import os
import subprocess
import sys

import pytest

from fleetserve.models.registry import default_model_path
from fleetserve.models.tokenizer import load_tokenizer, tokenizer_cache_dir

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief. Réponds en français."},
     {"role": "user", "content": "2+2? 你好 🙂"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}],
]


@pytest.fixture(scope="module")
def smollm2_dir():
    path = default_model_path()
    load_tokenizer(path)  # converts the GGUF's tokenizer once (cached)
    return tokenizer_cache_dir(path)


@pytest.fixture(scope="module")
def engine_tokenizer(smollm2_dir):
    return load_tokenizer(default_model_path())


@pytest.mark.parametrize("messages", CHATS)
def test_chat_ids_match_the_engine(smollm2_dir, engine_tokenizer, messages):
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    rt = RouterTokenizer(smollm2_dir)
    ours = rt.request_ids("/v1/chat/completions", {"messages": messages})
    text = engine_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    theirs = engine_tokenizer.encode(text, add_special_tokens=False)
    assert ours == theirs and len(ours) > 10
    # a tokenizer.json path works as well as its directory
    assert RouterTokenizer(os.path.join(smollm2_dir, "tokenizer.json")).request_ids(
        "/v1/chat/completions", {"messages": messages}) == theirs


def test_text_prompts_and_ids(smollm2_dir, engine_tokenizer):
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    rt = RouterTokenizer(smollm2_dir)
    s = "Once upon a time, in a land far away"
    assert rt.request_ids("/v1/completions", {"prompt": s}) == engine_tokenizer.encode(s)
    assert rt.request_ids("/generate", {"text": s}) == engine_tokenizer.encode(s)
    assert rt.request_ids("/generate", {"input_ids": [5, 6, 7]}) == [5, 6, 7]
    assert rt.request_ids("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch: routed by text
    assert rt.request_ids("/v1/chat/completions", {"messages": "nope"}) is None


def test_no_torch_after_loading_and_tokenizing(smollm2_dir):
    code = ("import sys; from fleetserve.router.kv_events.tokenize import RouterTokenizer; "
            f"t = RouterTokenizer({smollm2_dir!r}); "
            "assert t.request_ids('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'hi'}]}); "
            "import fleetserve.router.cli; assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr


def test_bad_tokenizer_path_is_one_line_naming_the_flag(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fleetserve.cli", "router", "--policy", "kv_aware",
                          "--tokenizer-path", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--tokenizer-path" in out.stderr.strip().splitlines()[-1]
    out = subprocess.run([sys.executable, "-m", "fleetserve.cli", "router", "--policy", "kv_aware",
                          "--kv-events-endpoint", "http://a:1=udp://x"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--kv-events-endpoint" in out.stderr.strip().splitlines()[-1]


def test_tokenizer_path_to_a_gguf_or_a_bad_file_is_one_line(tmp_path, capsys):
    from fleetserve.router import cli
    from fleetserve.router.config import parse_args

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\xff")
    with pytest.raises(SystemExit) as e:
        parse_args(["--policy", "kv_aware", "--tokenizer-path", str(gguf)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"fleetserve router: error: --tokenizer-path {gguf}: a .gguf file; give a directory with the model's tokenizer.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("not json")
    assert cli.main(["--port", "0", "--policy", "kv_aware", "--tokenizer-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fleetserve router: error: --tokenizer-path {tmp_path}: cannot read ")


def test_launch_gives_a_kv_aware_router_the_built_in_models_tokenizer(smollm2_dir):
    from fleetserve.launch import build_parser, router_tokenizer_args

    args, rest = build_parser().parse_known_args(["--policy", "kv_aware"])
    assert router_tokenizer_args(args, rest) == ["--tokenizer-path", smollm2_dir]
    args, rest = build_parser().parse_known_args(["--policy", "kv_aware", "--router-args", "--tokenizer-path /t"])
    assert router_tokenizer_args(args, rest) == []
    args, rest = build_parser().parse_known_args(["--model-path", "/m"])
    assert router_tokenizer_args(args, rest) == []  # cache_aware needs none
    # sim workers: theirs when they run the SmolLM2 tokenizer, none for their default word tokenizer
    args, rest = build_parser().parse_known_args(["--worker-kind", "sim", "--policy", "kv_aware",
                                                  "--tokenizer", "smollm2"])
    assert router_tokenizer_args(args, rest) == ["--tokenizer-path", smollm2_dir]
    args, rest = build_parser().parse_known_args(["--worker-kind", "sim", "--policy", "kv_aware"])
    assert router_tokenizer_args(args, rest) == []


@pytest.mark.parametrize("messages", [
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}],
    [{"role": "system", "content": None}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": None}, {"role": "user", "content": [{"type": "text", "text": "Again"}]}],
])
def test_chat_ids_match_our_engines_pipeline(smollm2_dir, engine_tokenizer, messages):
    """Text parts, the developer role and null contents are shaped as our engine shapes them before its
    template (chat_messages, template_messages) and count the same ids; before, a list of text parts was
    rendered as its Python repr and every such request disagreed with the engine (tokenizer check)."""
    from fleetserve.entrypoints.openai_protocol import ChatCompletionRequest
    from fleetserve.entrypoints.tokenizer_manager import chat_template_ids
    from fleetserve.entrypoints.tool_messages import template_messages
    from fleetserve.entrypoints.validation import chat_messages
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    req = ChatCompletionRequest(model="m", messages=messages)
    shaped, tools = template_messages(chat_messages(req), None, engine_tokenizer.chat_template)
    theirs = chat_template_ids(engine_tokenizer, shaped, tools)
    ours = RouterTokenizer(smollm2_dir).request_ids("/v1/chat/completions", {"messages": messages})
    assert ours == theirs and len(ours) > 5


def test_a_chat_with_an_image_part_has_no_ids(smollm2_dir):
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert RouterTokenizer(smollm2_dir).request_ids("/v1/chat/completions", body) is None


def test_the_chat_template_is_compiled_at_start_not_on_the_first_request(smollm2_dir, engine_tokenizer,
                                                                        monkeypatch):
    """Compiling SmolLM2's template took ~30 ms, paid on the event loop by the first chat request after
    start-up (a closed-loop run's first wave waited for it: kv_aware's TTFT p99 above cache_aware's)."""
    from fleetserve.router.kv_events import tokenize

    rt = tokenize.RouterTokenizer(smollm2_dir)
    assert rt.template_error is None

    def no_compiling():
        raise AssertionError("the chat template was compiled on a request")

    monkeypatch.setattr(tokenize, "_environment", no_compiling)
    messages = CHATS[1]
    text = engine_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rt.request_ids("/v1/chat/completions", {"messages": messages}) == engine_tokenizer.encode(
        text, add_special_tokens=False)


def test_a_template_that_does_not_compile_is_said_once_and_chats_go_by_text(smollm2_dir, tmp_path, caplog):
    import asyncio
    import logging
    import shutil

    from fleetserve.router.config import parse_args
    from fleetserve.router.kv_events.flags import make_kv_aware

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(os.path.join(smollm2_dir, "tokenizer.json"), folder / "tokenizer.json")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    with caplog.at_level(logging.WARNING, logger="fleetserve.router"):
        policy = make_kv_aware(parse_args(["--policy", "kv_aware", "--tokenizer-path", str(folder)]))
        started = [r.getMessage() for r in caplog.records]
        assert len(started) == 1
        assert started[0].startswith(f"--tokenizer-path {folder}: the chat template in "
                                     f"{folder / 'chat_template.jinja'} does not compile (line 1): "
                                     "TemplateSyntaxError")
        assert started[0].endswith("chat requests are routed on their text (branch=fallback reason=text)")
        caplog.clear()

        async def keys():
            chat = await policy.prepare("/v1/chat/completions", {"messages": CHATS[0]}, "x")
            completion = await policy.prepare("/v1/completions", {"prompt": "Once upon a time"}, "y")
            return chat, completion

        for _ in range(3):
            chat, completion = asyncio.run(keys())
            assert chat.tokens is None and not chat.tokenized  # routed on its text
            assert completion.tokens == policy.tokenizer.encode("Once upon a time") and completion.tokenized
        assert caplog.records == []  # nothing said per request


def _tok_dir(smollm2_dir, tmp_path, name, template=None, config=None):
    import json
    import shutil

    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(os.path.join(smollm2_dir, "tokenizer.json"), folder / "tokenizer.json")
    if template is not None:
        (folder / "chat_template.jinja").write_bytes(template)
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    return folder


@pytest.mark.parametrize("case, template, config, said", [
    ("not UTF-8", b"\xff\xfe{{ messages }}", None, "cannot read {jinja}: 'utf-8' codec can't decode"),
    ("empty file", b"  \n", None, "{jinja} is empty"),
    ("no default among named", None, {"chat_template": [{"name": "tool_use", "template": "{{ 1 }}"}]},
     "the chat templates in {cfg} have none named 'default'"),
    ("empty string", None, {"chat_template": ""}, "no chat template (no chat_template.jinja, none in {cfg})"),
    ("unknown filter", b"{{ messages | nosuchfilter }}", None,
     "the chat template in {jinja} does not compile (line 1): TemplateAssertionError: No filter named "
     "'nosuchfilter'; chat requests"),
])
def test_a_chat_template_the_router_cannot_use_is_one_warning_and_the_router_starts(
        smollm2_dir, tmp_path, caplog, case, template, config, said):
    """A user trial: a non-UTF-8 chat_template.jinja stopped the router from starting; a missing, empty or
    unnamed template routed every chat on its text without a word."""
    from fleetserve.router.config import parse_args
    from fleetserve.router.kv_events.flags import make_kv_aware

    folder = _tok_dir(smollm2_dir, tmp_path, "t", template, config)
    with caplog.at_level(logging.WARNING, logger="fleetserve.router"):
        policy = make_kv_aware(parse_args(["--policy", "kv_aware", "--tokenizer-path", str(folder)]))
    said = said.format(jinja=folder / "chat_template.jinja", cfg=folder / "tokenizer_config.json")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"--tokenizer-path {folder}: "), lines
    assert said in lines[0], lines[0]
    assert policy.tokenizer.request_ids("/v1/chat/completions", {"messages": CHATS[0]}) is None
    assert policy.tokenizer.request_ids("/v1/completions", {"prompt": "a b"}) == policy.tokenizer.encode("a b")


def test_a_template_that_refuses_a_chat_is_said_once(smollm2_dir, tmp_path, caplog):
    folder = _tok_dir(smollm2_dir, tmp_path, "r", b"{{ raise_exception('only tool chats here') }}")
    from fleetserve.router.kv_events.tokenize import RouterTokenizer

    rt = RouterTokenizer(str(folder))
    assert rt.template_error is None  # it compiles
    with caplog.at_level(logging.WARNING, logger="fleetserve.router"):
        for _ in range(3):
            assert rt.request_ids("/v1/chat/completions", {"messages": CHATS[0]}) is None
    assert [r.getMessage() for r in caplog.records] == [
        "kv_aware: a chat did not fit the chat template (ValueError: only tool chats here); such chats are "
        "routed on their text (branch=fallback reason=text; said once)"]


@pytest.mark.parametrize("config, said", [("[1, 2]", "holds a JSON list, not an object"),
                                          ("{not json", "cannot read {cfg}: Expecting property name")])
def test_a_bad_tokenizer_config_is_one_line_naming_the_file(smollm2_dir, tmp_path, capsys, config, said):
    from fleetserve.router import cli

    folder = _tok_dir(smollm2_dir, tmp_path, "c", config=config)
    assert cli.main(["--port", "0", "--policy", "kv_aware", "--tokenizer-path", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fleetserve router: error: --tokenizer-path {folder}: "), err
    assert said.format(cfg=folder / "tokenizer_config.json") in err[0] and "tokenizer_config.json" in err[0]


def test_text_size_counts_content_parts():
    """A user trial: a 5 M-character chat sent as content parts was tokenized (2.5 s a request) while the
    same text as a string was routed on its text; the size limit now sees the parts' texts."""
    from fleetserve.router.kv_events.tokenize import text_size

    parts = {"messages": [{"role": "system", "content": "abc"},
                          {"role": "user", "content": [{"type": "text", "text": "x" * 100},
                                                       {"type": "text", "text": "yz"}]}]}
    assert text_size("/v1/chat/completions", parts) == 105
    parts["messages"][1]["content"].append({"type": "image_url", "image_url": {"url": "u"}})
    assert text_size("/v1/chat/completions", parts) is None  # no ids to compute (template_chat)
    assert text_size("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}) is None
