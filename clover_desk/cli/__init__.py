"""The ``clover-desk`` command line: the dispatcher and one module per subcommand."""
