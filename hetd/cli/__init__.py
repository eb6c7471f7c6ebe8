"""The ``hetd`` command: its subcommands, the admin client and how their output is rendered."""
