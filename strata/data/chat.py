"""Chat templates: how a conversation becomes a prompt, the same on the server and in transformers.

An exported model carries its template in tokenizer_config.json (`chat_template`), so
`AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)` gives the prompt `python -m infer serve` builds for the same messages.
strata's models are base models, trained on plain text: DEFAULT_TEMPLATE writes each message as
`Role: content` and a blank line, and ends with `Assistant:` for the model to continue.
"""

from __future__ import annotations

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def compile_template(source: str):
    """A template as transformers compiles one (a sandbox: a template cannot reach Python objects).
    A ValueError names what is wrong with it."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


def render(template, messages: list[dict], *, add_generation_prompt: bool = True, **special) -> str:
    """The prompt for `messages` ({"role", "content"} with string contents). `special`: the tokenizer's
    tokens a template may use (bos_token, eos_token)."""
    from jinja2 import TemplateError

    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
    except TemplateError as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from None
