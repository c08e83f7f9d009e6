"""`python -m hf_powernorm.compare [options]`: the same as `hf-powernorm compare [options]`."""

import sys

from ..cli import run_command
from . import main

if __name__ == "__main__":
    run_command("compare", main, sys.argv[1:])
