"""transformers 5.19's chat-template cache and jinja2 3.1's sandbox, as raypipe.compat.transformers speeds them up:
the environment it patches is the one transformers renders with, and the sandbox stays in force.
tests/data/test_masks_property.py checks that the sped-up sandbox renders exactly like a fresh one."""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

from raypipe.compat.transformers import speed_up_chat_template_sandbox

# Templates of these tests only: the compiled templates are cached per string for the whole process.
ROLES = "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
UNSAFE = (
    "{{ messages.__class__.__mro__ }}",  # a private attribute: the sandbox refuses it
    "{{ messages[0].pop('role') }}",  # a mutating method of a dict: the immutable sandbox refuses it
)


def test_render_jinja_template_renders_in_the_cached_environment_that_is_sped_up() -> None:
    speed_up_chat_template_sandbox(ROLES)
    env = _compile_jinja_template(ROLES).environment
    assert _compile_jinja_template(ROLES) is _compile_jinja_template(ROLES) and env._raypipe_fast
    looked_up: list[str] = []
    fast = env.getattr
    env.getattr = lambda obj, name: looked_up.append(name) or fast(obj, name)
    try:
        texts, _ = render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=ROLES)
    finally:
        env.getattr = fast
    assert texts == ["user=hi;"] and looked_up == ["role", "content"]


@pytest.mark.parametrize("template", UNSAFE)
def test_the_sped_up_sandbox_still_refuses_what_the_sandbox_refuses(template: str) -> None:
    speed_up_chat_template_sandbox(template)
    with pytest.raises(SecurityError):
        render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=template)
