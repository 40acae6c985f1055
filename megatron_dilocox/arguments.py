"""``--dilocox-*`` flags for Megatron's ``extra_args_provider``, generated from ``DiLoCoXConfig``.

Every config field becomes one flag (``lowrank_rank`` -> ``--dilocox-lowrank-rank``; booleans get a
``--dilocox-no-*`` form), with the help text of the field, so the flags, the config and the flag
table in docs/configuration.md cannot drift apart. ``--dilocox`` turns DiLoCoX on; without it the run is
plain Megatron, and any other ``--dilocox-*`` flag is an error (it would otherwise be silently ignored).
The secret is never a flag: it comes from ``$DILOCOX_SECRET``.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Callable, Optional

from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError, flag_name, no_flag_name

NOT_FLAGS = ("secret",)


def _fields():
    hints = typing.get_type_hints(DiLoCoXConfig)
    for f in dataclasses.fields(DiLoCoXConfig):
        if f.name in NOT_FLAGS:
            continue
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        yield f, base


ALIASES = {"timeout_seconds": ("--dilocox-timeout",)}  # the short form the docs and issues use


def add_dilocox_args(parser: argparse.ArgumentParser, chain: Optional[Callable] = None) -> argparse.ArgumentParser:
    """Add the DiLoCoX flags; usable directly as Megatron's ``extra_args_provider``.

    ``chain``: another extra_args_provider to apply first (Megatron accepts only one)."""
    if chain is not None:
        parser = chain(parser) or parser
    group = parser.add_argument_group("DiLoCoX", "decentralized training across clusters (megatron_dilocox)")
    group.add_argument("--dilocox", action="store_true", help="enable DiLoCoX (otherwise plain Megatron)")
    for f, base in _fields():
        default = "auto" if base is bool and f.default is None else f.default
        text = f"{f.metadata.get('help', '')} (default: {default})"
        dest = "dilocox_" + f.name
        if base is bool:
            group.add_argument(flag_name(f.name), dest=dest, action="store_true", default=None, help=text)
            group.add_argument(no_flag_name(f.name), dest=dest, action="store_false", default=None,
                               help=argparse.SUPPRESS)
        else:
            group.add_argument(flag_name(f.name), *ALIASES.get(f.name, ()), dest=dest, type=base, default=None,
                               help=text)
    return parser


def chain_providers(*providers: Callable) -> Callable:
    """One extra_args_provider applying several in order (ours included)."""
    def provider(parser):
        for p in providers:
            parser = p(parser) or parser
        return parser
    return provider


def config_from_args(args) -> Optional[DiLoCoXConfig]:
    """The validated DiLoCoXConfig for these parsed args, or None when --dilocox is absent.

    Raises DiLoCoXConfigError (naming the flag) for any invalid value; call it before any process group."""
    given = {f.name: getattr(args, "dilocox_" + f.name) for f, _ in _fields()
             if getattr(args, "dilocox_" + f.name, None) is not None}
    if not getattr(args, "dilocox", False):
        if given:
            names = ", ".join(no_flag_name(n) if given[n] is False else flag_name(n) for n in sorted(given))
            raise DiLoCoXConfigError(f"{names} given without --dilocox; add --dilocox to enable DiLoCoX "
                                     f"or drop these flags for plain Megatron")
        return None
    return DiLoCoXConfig(**given).validate()


def flag_table() -> str:
    """Markdown table of every flag, default and meaning (docs/configuration.md embeds it; a test compares)."""
    rows = ["| flag | default | meaning |", "|---|---|---|", "| `--dilocox` | off | enable DiLoCoX |"]
    for f, base in _fields():
        name = f"`{flag_name(f.name)}`"
        if base is bool:
            name += f" / `{no_flag_name(f.name)}`"
        rows.append(f"| {name} | {'auto' if base is bool and f.default is None else f.default} | {f.metadata.get('help', '')} |")
    rows.append("| `$DILOCOX_SECRET` (environment) | – | shared secret, required with more than one cluster |")
    return "\n".join(rows)
