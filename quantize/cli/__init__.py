"""`quantize`: the command line, one module per command.

    app.py         the Typer app, consoles, --version / -q / -v, and the one place our errors
                   become a one-line message and exit 2 (every command goes through it)
    params.py      the parameters several commands share, and ConvertOptions from them
    run_record.py  convert's run record, --config / --from, the published command line
    convert_params.py  convert's own options (their types and help)
    inspect.py plan.py convert.py verify.py eval.py push.py   the commands

`main()` is the console entry point (`quantize`, `python -m quantize`).
"""

from __future__ import annotations

import importlib
import os
import sys

from quantize.cli.app import app

COMMANDS = ("inspect", "plan", "convert", "verify", "eval", "push")  # --help lists them so
for _name in COMMANDS:  # importing a command's module registers it on `app`
    importlib.import_module(f"quantize.cli.{_name}")

__all__ = ["app", "main"]


def main() -> None:  # pragma: no cover - console entry point
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if "--json" in sys.argv[1:]:  # stdout holds a JSON object however the run ends
        from quantize.cli.app import run_json

        sys.exit(run_json(sys.argv[1:]))
    app(prog_name="quantize")
