"""Chat-template rendering shared by ``/v1/chat/completions``, ``/tokenize`` and the offline
``LLM.chat``: one code path, so a conversation gives the same prompt tokens online and offline.

A conversation is validated as :class:`ChatMessage` objects (roles; text content parts are
joined with newlines), rendered with ``tokenizer.apply_chat_template(tokenize=False)``
(transformers' sandboxed Jinja, compiled once per template text) and encoded without the
tokenizer's own special tokens, since a chat template writes BOS itself (as vLLM and
transformers assume). Only pydantic and, lazily, jinja2 are imported: the offline API must not
need the web stack.
"""
from __future__ import annotations

from typing import Any, Sequence

from pydantic import ValidationError

from kvforge.config_messages import validation_message

from kvforge.entrypoints.openai.protocol import ChatMessage, TextPart

#: apply_chat_template arguments that ``chat_template_kwargs`` may not set: they change what the
#: call returns (token ids, tensors) or collide with the conversation passed to the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens"})
_MESSAGE_FIELDS = frozenset(ChatMessage.model_fields) | frozenset(TextPart.model_fields)


class ChatTemplateError(ValueError):
    """A conversation that could not be rendered.

    Attributes:
        param: the request field to blame (``messages``, ``chat_template``, ...).
        client_fault: True when the conversation or request caused it (a 400 online); False when
            the template itself is broken (online, the server's: a 500 the client cannot fix).
        detail: the underlying error, ``"TypeError: ..."``.
    """

    def __init__(self, message: str, param: str, client_fault: bool = True, detail: str = "") -> None:
        super().__init__(message)
        self.param = param
        self.client_fault = client_fault
        self.detail = detail or message


def _compile(template: str) -> Any:
    try:  # the exact environment apply_chat_template renders with (its compile is cached)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a private helper: fall back to the same sandbox, less its {% generation %} tag
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string(template)
    return _compile_jinja_template(template)


def compile_chat_template(template: str, source: str) -> None:
    """Check that ``template`` compiles, so a broken operator template stops start-up instead of
    failing every chat request.

    Args:
        template: Jinja chat template text.
        source: how the caller names it in errors (e.g. ``"--chat-template FILE"``).

    Raises:
        ValueError: ``"{source}: ..."`` for an empty template or a Jinja syntax error (with its line).
    """
    import jinja2
    if not template.strip():
        raise ValueError(f"{source}: the chat template is empty")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{source}: Jinja syntax error at line {e.lineno}: {e.message}") from None


def _field_path(loc: Sequence[Any]) -> str:
    # pydantic puts union-member tags ("str", "list[TextPart]") into error locations; keep fields and indexes
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc
                   if isinstance(p, int) or p in _MESSAGE_FIELDS)


def parse_messages(messages: Any, where: str = "messages") -> list[ChatMessage]:
    """Validate one conversation given as ``{"role", "content"}`` dicts (or ChatMessage objects).

    Raises:
        ValueError: naming the bad message and field, e.g. ``messages[1].role: ...``.
    """
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        got = "an empty list" if isinstance(messages, (list, tuple)) else type(messages).__name__
        raise ValueError(f"{where}: expected a non-empty list of {{'role': ..., 'content': ...}} dicts, got {got}")
    out = []
    for i, m in enumerate(messages):
        try:
            out.append(ChatMessage.model_validate(m))
        except ValidationError as e:
            errs = e.errors()
            # a union reports one error per member; the deepest one of the first bad field says most
            head = tuple(errs[0]["loc"])[:1]
            err = max((x for x in errs if tuple(x["loc"])[:1] == head), key=lambda x: len(x["loc"]))
            raise ValueError(f"{where}[{i}]{_field_path(err['loc'])}: {validation_message(err)}") from None
    return out


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the plain dicts chat templates expect (text parts joined by newlines)."""
    out = []
    for m in messages:
        d = {k: v for k, v in m.model_dump(exclude_none=True).items() if k != "content"}
        d["content"] = m.text()
        out.append(d)
    return out


def _check_list_of_dicts(value: Any, field: str) -> None:
    """Raise ChatTemplateError naming ``field`` unless ``value`` is None or a list of dicts."""
    if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
        raise ChatTemplateError(f"{field}: must be a list of objects, got {type(value).__name__}", field)


def render_chat(tokenizer: Any, messages: list[ChatMessage], template: str, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list | None = None,
                template_kwargs: dict[str, Any] | None = None, template_from_request: bool = False) -> str:
    """The prompt text of ``messages`` rendered with ``template``. Pure Python Jinja: slow for a
    heavy template, so the server runs it off its event loop.

    Args:
        tokenizer: a Hugging Face tokenizer (its special tokens are template variables).
        template: template text (or the name of one of the tokenizer's named templates).
        template_kwargs: extra template variables; ``add_generation_prompt``,
            ``continue_final_message``, ``tools`` and ``documents`` here override the arguments
            (as in vLLM); the keys in :data:`RESERVED_TEMPLATE_KWARGS` are refused.
        template_from_request: the template came with the request (then any failure is the
            request's fault).

    Raises:
        ChatTemplateError: the template refused the conversation (``raise_exception``) or
            ``continue_final_message`` cannot apply: client faults naming ``messages`` /
            ``continue_final_message``; a request template that fails: ``chat_template``; any
            other failure of a template the caller chose (syntax, undefined names, type errors):
            ``client_fault=False``.
    """
    import jinja2
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise ChatTemplateError(f"chat_template_kwargs: must be a dict, got {type(template_kwargs).__name__}",
                                "chat_template_kwargs")
    kwargs = dict(template_kwargs or {})
    _check_list_of_dicts(tools, "tools")
    for name in ("tools", "documents"):  # what templates iterate: a wrong type would fail inside them
        if name in kwargs:
            _check_list_of_dicts(kwargs[name], f"chat_template_kwargs.{name}")
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise ChatTemplateError(f"chat_template_kwargs.{name}: must be a bool, got {type(kwargs[name]).__name__}",
                                    f"chat_template_kwargs.{name}")
    kwargs.pop("chat_template", None)  # the caller already chose the template (see ``template``)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                                "chat_template_kwargs")
    call = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
            "tools": tools, **kwargs, "chat_template": template}
    try:
        return tokenizer.apply_chat_template(conversation(messages), tokenize=False, **call)
    except Exception as e:  # noqa: BLE001 - classified below: whose fault is it?
        detail = f"{type(e).__name__}: {e}"
        if type(e) is jinja2.TemplateError:  # the template's raise_exception(): it refuses this conversation
            raise ChatTemplateError(f"messages: the chat template refused the conversation: {e}",
                                    "messages") from e
        if template_from_request:
            raise ChatTemplateError(f"chat_template: the request's chat template failed: {detail}",
                                    "chat_template") from e
        if isinstance(e, ValueError):  # transformers' checks of the arguments, e.g. continue_final_message
            field = "continue_final_message" if call["continue_final_message"] else "messages"
            raise ChatTemplateError(f"{field}: {e}", field) from e
        raise ChatTemplateError(f"chat_template: the chat template failed: {detail}", "chat_template",
                                client_fault=False, detail=detail) from e


def encode_chat_prompt(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a rendered chat prompt. With ``add_special_tokens`` (a request option), a
    template that writes BOS itself would get a second one from the tokenizer: one is dropped."""
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_special_tokens and bos is not None and ids[:2] == [bos, bos]:
        ids = ids[1:]
    return ids
