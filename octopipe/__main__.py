"""`python -m octopipe` runs the `octopipe` command line (as `python -m octopipe.cli` does)."""

import sys

from octopipe import cli

exit_code = cli.main()
if cli._TORCHRUN_RANK_DONE:
    cli._end_torchrun_rank(exit_code)
sys.exit(exit_code)
