"""`python -m megatron_sortedrl <subcommand>`; see megatron_sortedrl/cli.py."""

import sys

from megatron_sortedrl.cli import main

if __name__ == "__main__":
    sys.exit(main())
