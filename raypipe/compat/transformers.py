"""transformers 5.19's private chat-template cache, and jinja2 3.1's sandbox methods, that the Jinja template
engine (raypipe.data.template_engine.JinjaEngine) relies on to render faster.

On an upgrade of either: run tests/compat/test_transformers.py and tests/data/test_masks_property.py (which renders
random conversations in the sped-up sandbox and in a fresh one and wants the same text).
"""

from __future__ import annotations

from typing import Any

_DICT_ATTRIBUTES = frozenset(dir(dict))


def speed_up_chat_template_sandbox(template: str) -> None:
    """Make the Jinja sandbox that `render_jinja_template` renders `template` in cheaper, without changing what it
    allows or returns (once per process and template).

    Relies on (transformers 5.19): `transformers.utils.chat_template_utils._compile_jinja_template` is an
    `lru_cache` over the template string, and `render_jinja_template` compiles through it; so the environment patched
    here is the one every later render of the same template uses. On an upgrade check that both still hold.
    """
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers imports torch

    _speed_up_sandbox(_compile_jinja_template(template).environment)


def _speed_up_sandbox(env: Any) -> None:
    """Two exact shortcuts in transformers' Jinja sandbox (jinja2's ImmutableSandboxedEnvironment), where templates
    spend most of their time in attribute look-ups:
    - `is_safe_attribute` looks only at the object's type and the attribute's name
      (private and internal names, mutating methods of known mutable types), so
      its verdict is cached per (type, name);
    - `message.role` on a plain dict: the sandbox first tries a Python attribute,
      which a dict has only for its own methods, then the key; for names that are
      not dict methods the key is looked up directly.
    Rendering gets about a quarter cheaper; the sandbox stays in force.

    Relies on (jinja2 3.1): compiled templates look attributes up through the environment's `getattr(obj, name)`,
    and the sandbox asks its `is_safe_attribute(obj, attr, value)` from there; both are instance-overridable. On an
    upgrade check that `is_safe_attribute` still depends on nothing but the type and the name.
    """
    if getattr(env, "_raypipe_fast", False):
        return
    cls = type(env)
    verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = verdicts[key] = cls.is_safe_attribute(env, obj, attr, value)
        return verdict

    def getattr_(obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return env.undefined(obj=obj, name=attribute)
        return cls.getattr(env, obj, attribute)

    env.is_safe_attribute = is_safe_attribute
    env.getattr = getattr_
    env._raypipe_fast = True
