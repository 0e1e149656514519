"""`python -m quantize ...`: the same CLI as `quantize ...` (also under torchrun)."""

from quantize.cli import main

main()
