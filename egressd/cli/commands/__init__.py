"""The egressctl commands, one module per command group; each defines its :class:`~egressd.cli.command.Command`
node(s), and :mod:`egressd.cli.egressctl` assembles them into the command tree."""
