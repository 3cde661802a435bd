"""Role messages rendered with the served model's own chat template.

A program's prompt grows by appending, so each message must add text after what is already
there. The conversation renders its messages so far and again with the new one (or with
the generation prompt, for an assistant message); the difference is that message's prefix
and suffix. A template's context-dependent parts, such as a default system prompt injected
when the conversation has none, come out exactly as the template renders them."""

from __future__ import annotations

import copy
import json
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixmesh.core.tokenizer import Tokenizer

Message = dict[str, str]
_PROBE = "\x00radixmesh-lang-content\x00"  # no template renders this on its own


class ChatTemplate:
    """Renders a conversation (with optional tools) as the model's chat template does."""

    def __init__(self, render: Callable[..., str]) -> None:
        self._render = render

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        return cls(tokenizer.apply_chat_template)

    @classmethod
    def from_source(cls, source: str, bos_token: str | None = None,
                    eos_token: str | None = None) -> ChatTemplate:
        """A template given as its Jinja text, rendered in the sandbox the server uses."""
        import tokenizers

        from radixmesh.core.tokenizer import Tokenizer

        # Only the template is needed: an empty vocabulary keeps the server's renderer.
        holder = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=source,
                           bos_token=bos_token, eos_token=eos_token)
        return cls.from_tokenizer(holder)

    @classmethod
    def from_model(cls, path: str | None = None) -> ChatTemplate:
        """The template of a model on this machine (None: the bundled default model)."""
        from radixmesh.core.tokenizer import Tokenizer

        return cls.from_tokenizer(Tokenizer.from_path(path))

    @classmethod
    def from_server(cls, url: str, api_key: str = "", timeout: float = 30.0) -> ChatTemplate:
        """The template a running mesh serves in its /get_model_info."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        request = urllib.request.Request(url.rstrip("/") + "/get_model_info", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            info = json.loads(reply.read())
        source = info.get("chat_template")
        if not source:
            raise ValueError(f"{url} serves no chat template in /get_model_info; "
                             "give the backend chat_template=ChatTemplate.from_model(path)")
        return cls.from_source(source, info.get("bos_token"), info.get("eos_token"))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        # Templates test `tools is defined` as well as `tools`: pass them only when given.
        extra = {"tools": list(tools)} if tools is not None else {}
        return self._render(list(messages), add_generation_prompt=add_generation_prompt,
                            **extra)


@dataclass
class Conversation:
    """The messages a state has rendered, and the one it is inside of."""

    template: ChatTemplate
    messages: list[Message] = field(default_factory=list)
    tools: tuple[Mapping[str, Any], ...] | None = None
    role: str | None = None  # the open message's role
    rendered: str = ""  # the conversation up to the open message's content

    def begin(self, role: str, tools: tuple[Mapping[str, Any], ...] | None) -> str:
        """Open a message of `role`: the text that goes before its content."""
        if self.role is not None:
            raise ValueError(f"a {role} message cannot begin inside a {self.role} message")
        if tools is not None and tools != self.tools:
            if self.messages:
                raise ValueError("give tools with the conversation's first message: "
                                 "templates render them ahead of every message")
            self.tools = tools
        # What a template renders for no messages at all (its tools, a BOS token) is
        # not in the prompt yet: the first message's prefix carries it.
        before = self._render(self.messages) if self.messages else ""
        if role == "assistant":
            # What a chat request would end with: the prompt to generate right here.
            opened = self._render(self.messages, add_generation_prompt=True)
            prefix = self._after(before, opened, role)
        else:
            probe = self._render([*self.messages, {"role": role, "content": _PROBE}])
            prefix = self._after(before, probe, role).split(_PROBE)[0]
        self.role, self.rendered = role, before + prefix
        return prefix

    def end(self, role: str, content: str) -> str:
        """Close the open message, whose content came out as `content`: the text after it."""
        if self.role != role:
            raise ValueError(f"{role}_end without {role}_begin"
                             + (f" (inside a {self.role} message)" if self.role else ""))
        message = {"role": role, "content": content}
        done = self._render([*self.messages, message])
        head = self.rendered + content
        if done.startswith(head):
            suffix = done[len(head):]
        else:
            # The template rewrites the content (trims it, say): take the text it puts
            # after any content.
            probe = self._render([*self.messages, {"role": role, "content": _PROBE}])
            suffix = probe.split(_PROBE)[1]
        self.messages.append(message)
        self.role = None
        return suffix

    def copy(self) -> Conversation:
        return Conversation(self.template, copy.deepcopy(self.messages), self.tools,
                            self.role, self.rendered)

    def _render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages, add_generation_prompt, self.tools)

    @staticmethod
    def _after(before: str, after: str, role: str) -> str:
        if not after.startswith(before):
            raise ValueError(f"the chat template renders the earlier messages differently "
                             f"once a {role} message follows; a program's prompt only grows")
        return after[len(before):]
