"""Subcommands of the ``infermux`` CLI (each module: ``add_parser(subparsers)``)."""
