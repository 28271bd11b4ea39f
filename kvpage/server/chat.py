"""Chat messages -> one prompt string.

A model directory with a `chat_template.jinja` file, or whose tokenizer_config.json has a
`chat_template`, is rendered with it (Jinja2, as Hugging Face does; the file first, as
transformers reads it). Every other model, the built-in ones included, uses this documented template:

    <|system|>\\nYou are terse.\\n<|user|>\\nHi\\n<|assistant|>\\n

one `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` for the reply to follow."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

Messages = list[dict[str, str]]


def simple_template(messages: Messages) -> str:
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n"


def load_chat_template(model: str) -> Callable[[Messages], str]:
    """The renderer for `model`: its HF chat template if it has one, else `simple_template`."""
    config_path = Path(model) / "tokenizer_config.json"
    jinja_path = Path(model) / "chat_template.jinja"  # where transformers >= 4.47 saves it
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    source = config.get("chat_template")
    if jinja_path.is_file():  # transformers reads the file over the config's field
        source = jinja_path.read_text()
    if isinstance(source, list):  # named templates: take the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return simple_template
    return _jinja_renderer(source, config)


def _jinja_renderer(source: str, config: dict) -> Callable[[Messages], str]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(source)
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}

    def render(messages: Messages) -> str:
        return template.render(messages=messages, add_generation_prompt=True, **specials)

    return render


def _token_text(token: object) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
