"""Chat templates: the tokenizer's or --chat-template (a file or the text), chat_template_kwargs, and errors."""

from __future__ import annotations

import argparse
import copy

import pytest

from distserve import cli
from distserve.config import ConfigError, parse_config
from distserve.engine.model_loader import load_tokenizer
from services.router.gateway.chat_template import ChatTemplate, chat_template_kwargs
from services.router.gateway.config import GatewayConfig
from services.router.gateway.errors import ApiError
from services.router.gateway.json_fields import Body
from services.router.gateway.openai_protocol import parse_chat

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
# Uses a chat_template_kwargs variable, as e.g. Qwen3's enable_thinking.
OVERRIDE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant{% if terse %} terse{% endif %}]{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def no_template_tokenizer(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    return bare


def error_of(call, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args, **kwargs)
    return caught.value


def test_the_tokenizers_template_renders_what_transformers_renders(tokenizer):
    template = ChatTemplate(tokenizer)
    text = template.render(CHAT)
    assert text == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert template.encode(CHAT) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert not template.render(CHAT, add_generation_prompt=False).endswith("<|assistant|>\n")


def test_an_override_wins_and_takes_kwargs(tokenizer):
    template = ChatTemplate(tokenizer, template=OVERRIDE)
    assert template.render(CHAT) == "[system] You write Python.\n[user] Sort a list.\n[assistant]"
    assert template.render(CHAT, {"terse": True}).endswith("[assistant terse]")
    assert template.encode(CHAT, {"terse": True}) == tokenizer(template.render(CHAT, {"terse": True}),
                                                                add_special_tokens=False)["input_ids"]


def test_continue_final_message_leaves_the_last_turn_open(tokenizer):
    chat = CHAT + [{"role": "assistant", "content": "def sort("}]
    text = ChatTemplate(tokenizer).render(chat, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("def sort(")


def test_no_template_and_no_flag_is_a_400_naming_the_flag(no_template_tokenizer):
    error = error_of(ChatTemplate(no_template_tokenizer).encode, CHAT)
    assert (error.status, error.param) == (400, "messages") and "--chat-template" in error.message
    assert ChatTemplate(no_template_tokenizer, template=OVERRIDE).encode(CHAT)


@pytest.mark.parametrize("value, param", [
    ([1], "chat_template_kwargs"), ("x", "chat_template_kwargs"),
    ({"tokenize": False}, "chat_template_kwargs.tokenize"), ({"messages": []}, "chat_template_kwargs.messages"),
    ({"chat_template": "{{ 1 }}"}, "chat_template_kwargs.chat_template")])
def test_bad_chat_template_kwargs_name_the_field(value, param):
    error = error_of(chat_template_kwargs, value)
    assert (error.status, error.param) == (400, param)


def test_chat_completions_pass_chat_template_kwargs(tokenizer):
    template = ChatTemplate(tokenizer, template=OVERRIDE)
    body = {"model": "m", "messages": CHAT, "chat_template_kwargs": {"terse": True}}
    assert list(parse_chat(Body(body), template).prompt) == template.encode(CHAT, {"terse": True})
    error = error_of(parse_chat, Body({**body, "chat_template_kwargs": [1]}), template)
    assert error.param == "chat_template_kwargs"


def test_a_template_failing_on_a_kwarg_is_a_400(tokenizer):
    template = ChatTemplate(tokenizer, template="{{ messages[0]['content'] + shout }}")
    assert error_of(template.encode, CHAT, {"shout": 1}).status == 400


def test_a_template_with_a_syntax_error_fails_at_start_naming_the_setting(tokenizer):
    with pytest.raises(ConfigError, match="^chat_template: "):
        ChatTemplate(tokenizer, template="{% for m in messages %}")
    ChatTemplate(tokenizer, template="{{ raise_exception('needs a system message') }}")  # valid: rejects later


def test_the_setting_is_a_file_or_the_text(tmp_path, monkeypatch):
    path = tmp_path / "t.jinja"
    path.write_text(OVERRIDE)
    assert parse_config(GatewayConfig, ["--chat-template", str(path)], "DISTSERVE_GATEWAY_").load_chat_template() \
        == OVERRIDE
    monkeypatch.setenv("DISTSERVE_GATEWAY_CHAT_TEMPLATE", OVERRIDE)
    assert parse_config(GatewayConfig, [], "DISTSERVE_GATEWAY_").load_chat_template() == OVERRIDE
    assert GatewayConfig().load_chat_template() is None
    assert GatewayConfig(chat_template="x" * 5000 + "{{ 1 }}").load_chat_template().endswith("{{ 1 }}")
    with pytest.raises(ConfigError, match="^chat_template: .*no such file"):
        GatewayConfig(chat_template=str(tmp_path / "missing.jinja")).load_chat_template()
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(ConfigError, match="^chat_template: .*empty"):
        GatewayConfig(chat_template=str(tmp_path / "empty.jinja")).load_chat_template()


def test_up_passes_the_template_to_the_gateway(tiny_model_path, tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    cli._add_cluster_args(parser)
    (tmp_path / "t.jinja").write_text(OVERRIDE)
    monkeypatch.chdir(tmp_path)
    spec = cli._spec(parser.parse_args(["--model", tiny_model_path, "--chat-template", "t.jinja"]))
    assert spec.gateway_args[-2:] == ["--chat-template", str(tmp_path / "t.jinja")]  # absolute: restarts find it
    spec = cli._spec(parser.parse_args(["--model", tiny_model_path, "--chat-template", OVERRIDE]))
    assert spec.gateway_args[-2:] == ["--chat-template", OVERRIDE]
    assert "--chat-template" not in cli._spec(parser.parse_args(["--model", tiny_model_path])).gateway_args
