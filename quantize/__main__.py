"""`python -m quantize ...`: the same CLI as `quantize ...` (also under torchrun)."""

from quantize.cli import app

app(prog_name="quantize")
