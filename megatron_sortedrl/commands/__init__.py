"""One module per command-line subcommand: `add_arguments(parser)` and `run(args) -> int`."""
