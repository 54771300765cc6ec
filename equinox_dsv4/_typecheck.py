"""Runtime type checks for the public entry points: a wrong type is refused with a `TypeError`
naming the argument, instead of being coerced (`chat_prompt(messages, thinking="auto")` would
otherwise run in thinking mode). Array arguments are checked against their jaxtyping shape
annotations too. Inside `jit` the checks run once, at trace time."""

from collections.abc import Callable
from typing import TypeVar

from beartype import beartype
from jaxtyping import jaxtyped


F = TypeVar("F", bound=Callable)

# Set on every checked entry point (the public-surface test reads it).
MARKER = "__equinox_dsv4_typechecked__"


def typechecked(fn: F) -> F:
    """`fn`, its arguments and return value checked against its annotations at each call."""
    checked = jaxtyped(typechecker=beartype)(fn)
    setattr(checked, MARKER, True)
    return checked
