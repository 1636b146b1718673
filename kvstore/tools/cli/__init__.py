"""``python -m kvstore``: the maintenance and demo command line, a thin layer over the
library (:mod:`kvstore.tools.cli.main` lists every command).  It may import what
:mod:`kvstore.tools` may, and ``fsck`` beside it.
"""
