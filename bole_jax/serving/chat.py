"""Chat prompts: the model's chat template (Jinja, sandboxed) and the tokenisation of the rendered
prompt with the messages' contents taken as text (special tokens typed by a client are not control
tokens)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger("bole_jax.serving")

_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


class TemplateError(ValueError):
    """The chat template rejected the messages (HTTP 400, param "messages")."""


class ChatTemplate:
    """Renders chat messages to a prompt string.

    Uses the model folder's tokenizer_config.json "chat_template" (Jinja, rendered in a sandbox as
    transformers does) when jinja2 is importable, else ChatML. `stop_token_ids`: tokens that end an
    assistant turn (the config's eos_token and the usual turn-end tokens present in the vocab); chat
    requests stop on them even when the model's EOS differs.
    """

    def __init__(self, source: str | None, tokenizer, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = None
        if source is not None:
            try:
                from jinja2.ext import loopcontrols
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                log.warning(
                    "jinja2 is not installed: chat prompts use ChatML instead of the model's "
                    "chat template (pip install jinja2)"
                )
            else:
                env = ImmutableSandboxedEnvironment(
                    trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
                )
                env.filters["tojson"] = _tojson
                env.globals["raise_exception"] = _raise_template_error
                env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
                self._template = env.from_string(source)
        ids = set()
        for tok in (eos_token, *_TURN_END_TOKENS):
            i = tokenizer.token_to_id(tok) if (tok and tokenizer is not None) else None
            if i is not None:
                ids.add(int(i))
        self.stop_token_ids = tuple(sorted(ids))

    @property
    def kind(self) -> str:
        return "model" if self._template is not None else "chatml"

    @property
    def supports_tools(self) -> bool:
        """Whether the template renders a `tools` list (a template that ignores it would drop the
        tool definitions silently)."""
        return self.source is not None and "tools" in self.source

    @classmethod
    def from_folder(cls, folder: Path | None, tokenizer) -> "ChatTemplate":
        source, bos, eos = None, "", ""
        cfg_path = folder / "tokenizer_config.json" if folder is not None else None
        if cfg_path is not None and cfg_path.exists():
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            source = cfg.get("chat_template")
            if isinstance(source, list):  # [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default") or next(iter(named.values()), None)
            bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        # transformers' precedence: a chat_template.jinja file wins over tokenizer_config.json's
        jinja_file = folder / "chat_template.jinja" if folder is not None else None
        if jinja_file is not None and jinja_file.exists():
            source = jinja_file.read_text(encoding="utf-8")
        return cls(source if isinstance(source, str) else None, tokenizer, bos, eos)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text. `tools`: OpenAI tool definitions handed to the template as `tools`;
        `template_kwargs`: extra template variables (e.g. enable_thinking); they cannot override
        messages, tools, add_generation_prompt or the special-token variables."""
        if self._template is None:
            return (
                "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
                + "<|im_start|>assistant\n"
            )
        from jinja2 import TemplateError as JinjaError

        ctx = {
            **(template_kwargs or {}),
            "messages": messages,
            "add_generation_prompt": True,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if tools:
            ctx["tools"] = tools
        try:
            return self._template.render(**ctx)
        except JinjaError as e:
            raise TemplateError(f"the chat template rejected the messages: {e}") from None


class PromptEncoder:
    """Tokenises rendered chat prompts so that the text of the messages never becomes control
    tokens: a client typing "<|im_start|>system" into its content must not open a system turn.

    The rendered prompt is split at the messages' contents (found in order in the rendered text);
    the template's own parts are tokenised as usual, the contents with special tokens taken as
    text. Only a prompt whose contents hold a special token's text is split (so ordinary prompts
    tokenise exactly as a whole); a content the template transformed (not found verbatim) and
    that holds special-token text is rejected.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        raw = getattr(tokenizer, "_tok", None)
        self._literal = None
        self.specials: tuple[str, ...] = ()
        if raw is not None:
            from tokenizers import Tokenizer

            self.specials = tuple(
                sorted(
                    t.content
                    for t in raw.get_added_tokens_decoder().values()
                    if t.special and t.content
                )
            )
            self._literal = Tokenizer.from_str(raw.to_str())
            self._literal.encode_special_tokens = True

    def has_special(self, text: str) -> bool:
        return any(s in text for s in self.specials)

    def encode(self, prompt: str, contents: list[str]) -> list[int]:
        if self._literal is None or not any(self.has_special(c) for c in contents):
            return self.tokenizer.encode(prompt)
        ids: list[int] = []
        pos = 0
        for c in contents:
            if not self.has_special(c):
                continue
            at = prompt.find(c, pos)
            if at < 0:
                raise TemplateError(
                    "a message content holds special-token text that the chat template "
                    "transformed: remove the special tokens from the content"
                )
            if at > pos:
                ids += self.tokenizer.encode(prompt[pos:at])
            ids += self._literal.encode(c, add_special_tokens=False).ids
            pos = at + len(c)
        if pos < len(prompt):
            ids += self.tokenizer.encode(prompt[pos:])
        return ids


def _token_text(tok) -> str:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else ""


def _tojson(x, indent=None, ensure_ascii=False):
    return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)


def _raise_template_error(message):
    from jinja2 import TemplateError as JinjaError

    raise JinjaError(message)
