"""Conversation -> text, and the exact text an environment's observation adds to an episode's stream.

What it does: a format renders a list of messages. ``TemplateFormat`` is the tokenizer's chat
template (with ``tools=`` when the template uses tools); ``PlainFormat`` is for models without one
(the embedded character-level model): contents concatenated, tool results wrapped in
``<result>...</result>``. ``observation_text`` gives the text to append, as token ids, after the
model's turn: what the template writes after the model's last token (e.g. ChatML's newline after
``<|im_end|>``; the end-of-turn token itself when the turn ended at a stop string), the
observation messages, and the next assistant header. It requires that the template *appends*:
``render(conversation + observation)`` starts with ``render(conversation)``. Templates that rewrite
earlier turns (Qwen3's, which drops past ``<think>`` blocks) are refused with that reason, because
the tokens the model was trained on would not be the tokens it saw.

What it deliberately does not do: tokenize the model's turns. They stay the ids that were sampled;
only the text between them is rendered here and encoded once.
"""

from __future__ import annotations

from grpokit.errors import ConfigError


class PlainFormat:
    """Messages concatenated as they are; a tool message as ``<result>content</result>``."""

    tool_open, tool_close = "<result>", "</result>"

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer  # its special tokens (EOS) end a turn but are not content

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        parts = []
        for m in messages:
            if m["role"] == "tool":
                parts.append(f"{self.tool_open}{m['content']}{self.tool_close}")
            else:
                parts.append(m["content"])
        return "".join(parts)


class TemplateFormat:
    """The tokenizer's chat template; ``tools`` (JSON schemas) go to ``tools=`` if it renders them."""

    def __init__(self, tokenizer, tools: list[dict] | None = None) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError("TemplateFormat needs a tokenizer with a chat template; use PlainFormat")
        self.tokenizer = tokenizer
        self.tools = tools if tools and "tools" in str(template) else None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        kw = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
        )


def conversation_format(tokenizer, tools: list[dict] | None = None):
    """The tokenizer's chat template when it has one, else the plain format."""
    if getattr(tokenizer, "chat_template", None):
        return TemplateFormat(tokenizer, tools)
    return PlainFormat(tokenizer)


def observation_text(fmt, before: list[dict], turn_text: str, observation: list[dict]) -> str:
    """The text to append after the model's last token, given the conversation ``before`` its turn
    (ending where the assistant header was rendered), the turn as the model wrote it (decoded with
    special tokens, e.g. ending in ``<|im_end|>``), and the observation messages.

    Raises ConfigError when the format does not render conversations by appending."""
    content = assistant_content(fmt, turn_text)
    head = fmt.render(before, add_generation_prompt=True)
    with_turn = fmt.render([*before, {"role": "assistant", "content": content}])
    after = fmt.render(
        [*before, {"role": "assistant", "content": content}, *observation], add_generation_prompt=True
    )
    if not with_turn.startswith(head) or not after.startswith(with_turn):
        raise ConfigError(
            "the chat template does not render a conversation by appending to it (it rewrites earlier "
            "turns, as Qwen3's does with past <think> blocks), so the tokens of a multi-turn episode "
            "could not be the tokens the model saw; use a template that appends (ChatML: Qwen2.5, SmolLM2)"
        )
    rendered_turn = with_turn[len(head) :]
    # what the template writes after the model's last token: after its end-of-turn token when the model
    # wrote it (turn_text is a prefix of the rendered turn), else the whole closing (a stop string ended it)
    if rendered_turn.startswith(turn_text):
        tail = rendered_turn[len(turn_text) :]
    elif turn_text.startswith(rendered_turn):
        tail = ""  # the model wrote more than the template shows (PlainFormat: the EOS token)
    else:
        raise ConfigError(
            "the chat template changes an assistant turn's text when it renders it (e.g. strips "
            "whitespace), so the episode's tokens could not match the conversation; "
            f"model wrote {turn_text[-40:]!r}, template renders {rendered_turn[-40:]!r}"
        )
    return tail + after[len(with_turn) :]


def assistant_content(fmt, turn_text: str) -> str:
    """The assistant message's content: the turn's text without the special tokens it ends with."""
    tok = getattr(fmt, "tokenizer", None)
    if tok is None:
        return turn_text
    text = turn_text
    specials = sorted((s for s in tok.all_special_tokens if s), key=len, reverse=True)
    stripped = True
    while stripped:
        stripped = False
        for s in specials:
            if text.endswith(s):
                text, stripped = text[: -len(s)], True
    return text
