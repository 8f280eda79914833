"""The README's command table against the CLI: every flag a command's row names is an option of
that command (or, for the `data` rows, of one of the data commands the row names)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

ROOT = Path(__file__).resolve().parents[1]


def _options(cmds: list[Any]) -> set[str]:
    """Every --flag of these commands (typer's click objects) and of their subcommands."""
    out: set[str] = set()
    for cmd in cmds:
        for p in cmd.params:
            out.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
        out |= _options(list(getattr(cmd, "commands", {}).values()))
    return out


def test_every_flag_a_command_row_names_is_that_commands():
    from draftsmith.cli import _register, app

    _register()
    group = typer.main.get_command(app)
    rows = [r for r in (ROOT / "README.md").read_text().splitlines()
            if r.startswith("| `draftsmith ")]
    assert len(rows) >= 14
    for row in rows:
        name = re.match(r"\| `draftsmith ([a-z-]+)", row).group(1)
        cmds = [group.commands[name]]
        subs = getattr(cmds[0], "commands", {})
        if subs:  # `data make`, `data prompts / regenerate / ...`: the data commands it names
            words = set(re.findall(r"[a-z]+", row.split("|")[1]))
            cmds = [c for n, c in subs.items() if n in words]
            assert cmds, row[:80]
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", row))
        unknown = sorted(flags - _options(cmds) - {"--help"})
        assert not unknown, f"draftsmith {name}: the README names {unknown}"
