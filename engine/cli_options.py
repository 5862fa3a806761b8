"""Click options whose defaults and help come from the parameter classes and functions they
feed, so each default has one home (engine/astec/config.py, ExportOptions, RetrainSettings, ...)
and `--help` says what the code does."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource


def default_of(owner: Any, name: str) -> Any:
    """The default of field `name` of a dataclass, or of parameter `name` of a function."""
    label = getattr(owner, "__name__", repr(owner))
    if dataclasses.is_dataclass(owner):
        for f in dataclasses.fields(owner):
            if f.name == name:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
                raise ValueError(f"{label}.{name} has no default")
        raise ValueError(f"{label} has no field {name!r}")
    p = inspect.signature(owner).parameters[name]
    if p.default is inspect.Parameter.empty:
        raise ValueError(f"{label}({name}) has no default")
    return p.default


def help_of(cls: type, name: str) -> str:
    """The help text a dataclass field carries in its metadata."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.metadata["help"])
    raise ValueError(f"{cls.__name__} has no field {name!r}")


def config_option(
    cls: type, name: str, *decls: str, **kw: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An option overriding field `name` of a config section `cls`: unset (None), the --config
    file's value, else the class default, stands; its help is the field's."""
    text = f"{help_of(cls, name)} Default: the --config file's, else {default_of(cls, name)!r}."
    return click.option(*decls, default=None, help=text, **kw)


def renamed_option(
    new: str, old: str, dest: str, **kw: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Option `new` (its documented spelling) with `old` kept as a hidden, deprecated alias, so
    scripts written for the old spelling still run; giving both is a usage error. Works on any
    click >= 8.1: the alias hands its value over through ctx.meta instead of sharing `dest`."""
    key = f"astec.renamed_option.{dest}"

    def on_new(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if key not in ctx.meta:
            return value
        if ctx.get_parameter_source(dest) not in (None, ParameterSource.DEFAULT):
            raise click.UsageError(f"give {new} or its old spelling {old}, not both")
        return ctx.meta[key]

    def on_old(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        given = ctx.get_parameter_source(param.name or "") not in (None, ParameterSource.DEFAULT)
        if value is None or not given:
            return value
        if dest in ctx.params:  # `new` came first on the command line
            raise click.UsageError(f"give {new} or its old spelling {old}, not both")
        click.echo(f"warning: {old} is deprecated; use {new}", err=True)
        ctx.meta[key] = value
        return value

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        alias = {k: v for k, v in kw.items() if k in ("type", "is_flag", "multiple")}
        f = click.option(
            old, f"{dest}_old_spelling", hidden=True, expose_value=False, callback=on_old, **alias
        )(f)
        return click.option(new, dest, callback=on_new, **kw)(f)

    return decorate
