"""`python -m kbit_core ...` runs the `kbit` CLI where the console script is not installed (a carried checkout)."""

from kbit_core.cli import main

main()
