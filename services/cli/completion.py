"""Shell completion for ``ringwatch``, written from the command line's own parser, so it
offers exactly the commands and flags the CLI accepts.

    eval "$(ringwatch completion bash)"     # in ~/.bashrc
    eval "$(ringwatch completion zsh)"      # in ~/.zshrc
"""

from __future__ import annotations

import argparse


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--"))


def _choices(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Flags whose values are a fixed set (--backend nccl|gloo|sim, --profile ...)."""
    return {s: [str(c) for c in a.choices] for a in parser._actions if a.choices
            and not isinstance(a, argparse._SubParsersAction) for s in a.option_strings}


def words(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """What completes after each command path ("" for the top level): subcommands, then
    flags; and "PATH FLAG" for a flag's values."""
    out: dict[str, list[str]] = {}

    def walk(path: str, p: argparse.ArgumentParser) -> None:
        subs = _subparsers(p)
        positional = [str(c) for a in p._actions if a.choices and not a.option_strings
                      and not isinstance(a, argparse._SubParsersAction) for c in a.choices]
        out[path] = sorted(subs) + positional + _flags(p)
        for flag, values in _choices(p).items():
            out[f"{path} {flag}".strip()] = values
        for name, sub in subs.items():
            walk(f"{path} {name}".strip(), sub)

    walk("", parser)
    return out


def bash(parser: argparse.ArgumentParser) -> str:
    table = words(parser)
    cases = "\n".join(f'        "{key}") opts="{" ".join(values)}" ;;'
                      for key, values in sorted(table.items()))
    return f'''# ringwatch completion for bash (and zsh through bashcompinit)
_ringwatch() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    local path="" w i opts=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        case "$w" in -*) ;; *) [ -n "$(_ringwatch_opts "${{path:+$path }}$w")" ] \\
            && path="${{path:+$path }}$w" ;; esac
    done
    opts="$(_ringwatch_opts "${{path:+$path }}$prev")"
    [ -z "$opts" ] && opts="$(_ringwatch_opts "$path")"
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
}}
_ringwatch_opts() {{
    local opts=""
    case "$1" in
{cases}
    esac
    printf '%s' "$opts"
}}
complete -o default -F _ringwatch ringwatch
'''


def zsh(parser: argparse.ArgumentParser) -> str:
    return "autoload -U +X bashcompinit && bashcompinit\n" + bash(parser)
