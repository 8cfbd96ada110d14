"""Offline ``LLM.chat`` (vLLM's semantics) on stories260K: the prompt is the conversation
rendered by the same code as ``/v1/chat/completions`` (content parts joined, no second BOS),
one conversation or a batch, and bad input named before anything is queued."""
from __future__ import annotations

import pytest

from kvforge import SamplingParams
from test_server_common import CHAT_TEMPLATE, reference_llm, server  # noqa: F401

#: A template that writes BOS itself, as real chat templates do.
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
CONV = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def llm():
    return reference_llm()


def test_chat_uses_the_tokenizers_template_without_a_second_bos(llm, monkeypatch):
    tok = llm.get_tokenizer()
    monkeypatch.setattr(tok, "chat_template", BOS_TEMPLATE, raising=False)
    (out,) = llm.chat(CONV, GREEDY, use_tqdm=False)
    expected = tok.apply_chat_template(CONV, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(expected)
    assert out.prompt == "<s>system: You tell stories.\nuser: Once upon a time\nassistant:"
    assert out.prompt_token_ids[0] == tok.bos_token_id and out.prompt_token_ids[1] != tok.bos_token_id
    assert out.finished and out.outputs[0].token_ids and out.outputs[0].finish_reason in ("length", "stop")
    (ref,) = llm.generate({"prompt_token_ids": list(expected)}, GREEDY, use_tqdm=False)
    assert out.outputs[0].text == ref.outputs[0].text


def test_chat_batch_content_parts_and_explicit_template(llm, server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]}]
    joined = [{"role": "user", "content": "Once upon\na time"}]
    outs = llm.chat([parts, joined, CONV], [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=3)],
                    use_tqdm=False, chat_template=CHAT_TEMPLATE)
    assert len(outs) == 3 and outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert outs[0].outputs[0].text == outs[1].outputs[0].text and len(outs[2].outputs[0].token_ids) == 3
    with server.client() as c:                               # the server renders the same prompt tokens
        for conv, out in zip((parts, CONV), (outs[0], outs[2])):
            r = c.post("/tokenize", json={"messages": conv})
            assert r.status_code == 200 and r.json()["tokens"] == out.prompt_token_ids, r.text


def test_chat_continue_final_message(llm):
    conv = CONV + [{"role": "assistant", "content": "There was a"}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE, add_generation_prompt=False,
                      continue_final_message=True)
    assert out.prompt.endswith("assistant: There was a") and out.outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conv, GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE, continue_final_message=True)


@pytest.mark.parametrize("messages, kw, match", [
    ([{"role": "wizard", "content": "x"}], {}, r"^messages\[0\]\.role: "),
    ([CONV, [{"role": "user", "content": 5}]], {}, r"^messages\[1\]\[0\]\.content: "),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], {}, r"^messages\[0\]\.content: "),
    ([], {}, r"^messages: expected a non-empty list"),
    ("hello", {}, r"^messages: expected a non-empty list"),
    (CONV, {"chat_template": "{% if x %}"}, r"^chat_template: the chat template failed: TemplateSyntaxError"),
    ([CONV, CONV], {"chat_template": "{{ raise_exception('no system messages') }}"},
     r"^messages\[0\]: the chat template refused the conversation: no system messages"),
    (CONV, {"chat_template": None}, r"^chat_template: the model's tokenizer has no chat template"),
])
def test_chat_bad_input_is_named_and_queues_nothing(llm, messages, kw, match):
    kw.setdefault("chat_template", CHAT_TEMPLATE)
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False, **kw)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_template_kwargs_and_tools_reach_the_template(llm):
    template = ("{% if greeting %}{{ greeting }} {% endif %}{% for t in tools or [] %}[{{ t['name'] }}]{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (out,) = llm.chat([{"role": "user", "content": "Once upon a time"}], GREEDY, use_tqdm=False,
                      chat_template=template, chat_template_kwargs={"greeting": "Hi"}, tools=[{"name": "clock"}])
    assert out.prompt == "Hi [clock]Once upon a time"
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(CONV, GREEDY, use_tqdm=False, chat_template=template, chat_template_kwargs={"tokenize": True})
