"""`python -m bmeg ...` is the `bmeg` command (as `torchrun -m bmeg train ...` starts it)."""

from bmeg.cli import main

main(prog_name="bmeg")
