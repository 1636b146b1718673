"""``python -m kvstore``: the maintenance and demo CLI (see :mod:`kvstore.cli.main`)."""
