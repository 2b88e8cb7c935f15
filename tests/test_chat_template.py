"""Chat templates render byte-identical to transformers' ``apply_chat_template`` (the oracle),
run sandboxed, and fail with clear errors; the server answers a refused template with 400."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jinja2
import pytest

from moe_runtime.chat_template import ChatTemplateError
from moe_runtime.errors import CheckpointError, RequestError
from moe_runtime.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
BUNDLED_TOKENIZER = (
    Path(__file__).resolve().parents[1] / "moe_runtime" / "assets" / "tiny-moe" / "tokenizer.json"
)
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__()|length }}"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
}
CALL_DICT_ARGS = {
    "id": "call_2",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
}
SYS = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "Hi"}
A1 = {"role": "assistant", "content": "Hello! How can I help?"}
U2 = {"role": "user", "content": "What's the weather in Zürich and Oslo?"}
A_CALLS = {"role": "assistant", "content": None, "tool_calls": [CALL, CALL_DICT_ARGS]}
A_CALL_TEXT = {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]}
T1 = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "12 C, rain"}
T2 = {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "3 C, snow"}
A_FINAL = {"role": "assistant", "content": "Zürich 12 C and rainy; Oslo 3 C with snow."}
A_THINK = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}
A_REASON = {"role": "assistant", "content": "4", "reasoning_content": "2 plus 2"}
A_OLD_REASON = {"role": "assistant", "content": "4", "reasoning": "counted"}
U_NAMED = {"role": "user", "content": "Who am I?", "name": "ada"}

CASES: dict[str, list[list[dict]]] = {
    "qwen3_style": [
        [U1],
        [SYS, U1],
        [U1, A1, U2],
        [SYS, U1, A1, U2],
        [U2, A_CALLS, T1, T2],
        [SYS, U2, A_CALL_TEXT, T1],
        [U2, A_CALLS, T1, T2, A_FINAL],
        [U2, A_CALLS, T1, T2, A_FINAL, U1],
        [U1, A_THINK],
        [U1, A_THINK, U2],
        [U1, A_REASON],
        [U1, A_OLD_REASON],
        [U1, A_REASON, U2, A1],
        [SYS, U1, SYS],
    ],
    "mixtral_style": [
        [U1],
        [SYS, U1],
        [U1, A1, U2],
        [SYS, U1, A1, U2],
        [SYS, U1, A1],
        [U1, A_REASON, U2],
        [U_NAMED],
        [SYS, U_NAMED, A1, U2, A_FINAL, U1],
    ],
    "deepseek_style": [
        [U1],
        [SYS, U1],
        [SYS, SYS, U1, A1, U2],
        [U_NAMED, A1],
        [U2, A_CALLS, T1, T2],
        [SYS, U2, A_CALL_TEXT, T1, A_FINAL],
        [U1, A_THINK, U2],
        [U1, A_REASON],
        [A1, U1],
        [U2, A_CALLS, T1, T2, A_FINAL, U1],
    ],
}
SPECIAL = {
    "qwen3_style": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
    "mixtral_style": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "deepseek_style": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
}
# (tools, documents, template kwargs) each template is rendered with, besides its messages
OPTIONS = {
    "qwen3_style": [(None, None, {}), ([WEATHER], None, {}), (None, None, {"enable_thinking": False})],
    "mixtral_style": [(None, None, {})],
    "deepseek_style": [
        (None, None, {"date_string": "23 Nov 2026"}),
        ([WEATHER], [{"title": "Alps", "text": "High."}], {"thinking": True}),
    ],
}


def write_checkpoint(path: Path, template: str | list | None, special: dict | None = None) -> Path:
    """A folder with the bundled tokenizer and ``template`` as its chat template."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(BUNDLED_TOKENIZER, path / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **(special or {"eos_token": "<|endoftext|>"})}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``pair(name)``: our and transformers' tokenizer over the same folder with template ``name``."""
    from transformers import AutoTokenizer

    made: dict[str, tuple[Tokenizer, object]] = {}

    def get(name: str) -> tuple[Tokenizer, object]:
        if name not in made:
            template = (TEMPLATES / f"{name}.jinja").read_text()
            folder = write_checkpoint(tmp_path_factory.mktemp(name), template, SPECIAL[name])
            made[name] = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(CASES))
def test_renders_byte_identical_to_transformers(pair, name):
    ours, theirs = pair(name)
    checked = 0
    for messages in CASES[name]:
        for tools, documents, kwargs in OPTIONS[name]:
            for gen in (True, False):
                expected = theirs.apply_chat_template(
                    messages,
                    tools=tools,
                    documents=documents,
                    add_generation_prompt=gen,
                    tokenize=False,
                    **kwargs,
                )
                got = ours.apply_chat_template(
                    messages, add_generation_prompt=gen, tools=tools, documents=documents, **kwargs
                )
                assert got == expected, (name, messages, tools, kwargs, gen)
                checked += 1
    assert checked == len(CASES[name]) * len(OPTIONS[name]) * 2


@pytest.mark.parametrize("name", ["qwen3_style", "deepseek_style"])  # Mixtral's has no tool roles
def test_tool_call_history_reaches_the_template(pair, name):
    ours, _ = pair(name)
    text = ours.apply_chat_template([U2, A_CALLS, T1, T2])
    assert "Zürich" in text and '"Oslo"' in text and "12 C, rain" in text
    if name == "deepseek_style":
        assert '{"id":"call_1","name":"get_weather"}' in text and "call_2: 3 C, snow" in text


@pytest.mark.parametrize("name", sorted(CASES))
def test_continue_final_message_matches_transformers(pair, name):
    ours, theirs = pair(name)
    messages = [U1, {"role": "assistant", "content": "Hello! I am "}]
    expected = theirs.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert (
        ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        == expected
    )
    assert expected.rstrip().endswith("Hello! I am") and "CONTINUE" not in expected
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_refusals_are_template_errors(pair):
    ours, theirs = pair("mixtral_style")  # Mixtral's template refuses roles that do not alternate
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        ours.apply_chat_template([U1, U2])
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        theirs.apply_chat_template([U1, U2], tokenize=False)


def test_sandbox_refuses_python_internals(tmp_path):
    tok = Tokenizer(write_checkpoint(tmp_path, ESCAPE))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([U1])
    tok = Tokenizer(write_checkpoint(tmp_path / "ns", "{% set n = namespace() %}{% set n._x = 1 %}"))
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        tok.apply_chat_template([U1])
    tok = Tokenizer(
        write_checkpoint(tmp_path / "mut", "{% set m = messages[0] %}{{ m.update({'role': 1}) }}")
    )
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([U1])


def test_named_templates_and_jinja_files(tmp_path):
    named = [{"name": "default", "template": "D{{ messages|length }}"}, {"name": "tool_use", "template": "T"}]
    tok = Tokenizer(write_checkpoint(tmp_path / "list", named))
    assert tok.apply_chat_template([U1]) == "D1"
    assert tok.apply_chat_template([U1], tools=[WEATHER]) == "T"
    assert tok.apply_chat_template([U1], chat_template="tool_use") == "T"
    with pytest.raises(ChatTemplateError, match="unknown chat template 'rag'"):
        tok.apply_chat_template([U1], chat_template="rag")
    folder = write_checkpoint(tmp_path / "files", "ignored: the .jinja file wins")
    (folder / "chat_template.jinja").write_text("J{{ messages[0].content }}\n")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "rag.jinja").write_text("R")
    tok = Tokenizer(folder)
    assert (
        tok.apply_chat_template([U1]) == "JHi" and tok.apply_chat_template([U1], chat_template="rag") == "R"
    )
    assert sorted(tok.chat_templates) == ["default", "rag"]


def test_bad_templates_and_options_fail_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="'default' does not parse"):
        Tokenizer(write_checkpoint(tmp_path / "syntax", "{% if %}"))
    with pytest.raises(CheckpointError, match="chat_template must be a string or a list"):
        Tokenizer(write_checkpoint(tmp_path / "shape", {"default": "x"}))
    tok = Tokenizer(write_checkpoint(tmp_path / "ok", "{{ messages[0].content + 1 }}"))
    with pytest.raises(ChatTemplateError, match="TypeError") as info:
        tok.apply_chat_template([U1])
    assert isinstance(info.value, RequestError) and isinstance(info.value, jinja2.TemplateError)
    with pytest.raises(ChatTemplateError, match="may not set messages"):
        tok.apply_chat_template([U1], chat_template_kwargs={"messages": []})


def test_fallback_without_a_template(tmp_path):
    tok = Tokenizer(write_checkpoint(tmp_path, None))
    assert tok.apply_chat_template([SYS, U1]) == "system: You are terse.\nuser: Hi\nassistant:"


def test_server_answers_400_to_the_escape_and_serves_a_qwen3_style_template(tiny_qwen3, tmp_path):
    from moe_runtime.config import RuntimeConfig
    from moe_runtime.engine.engine import LLMEngine
    from server.settings import ServerSettings
    from server.testing import serve_in_thread

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "qwen3_style.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = LLMEngine.from_pretrained(folder, RuntimeConfig(max_batch_size=2, max_model_len=128))
    body = {"messages": [U1], "max_tokens": 2, "temperature": 0}
    with serve_in_thread(engine, ServerSettings(max_wait_ms=0)) as running:
        state = running.app.state.server
        with httpx.Client(base_url=running.base_url, timeout=60) as http:
            ok = http.post("/v1/chat/completions", json=body)
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["prompt_tokens"] == len(
                state.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False)
            )
            state.tokenizer.chat_templates["default"] = ESCAPE  # as if the checkpoint shipped it
            refused = http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "messages" and "unsafe" in error["message"]
