"""What operators run: the offline check and repair (``fsck``: the checks; the repairs
they call for in ``fsck_repairs``, the index rebuilt from the extents in
``fsck_rebuild``, its file reads and writes in ``fsck_files`` and its findings in
``fsck_report``) and the command line
(:mod:`kvstore.tools.cli`, ``python -m kvstore`` and the ``kvstore`` script).  It may
import the public API (``kvstore``), :mod:`kvstore.core`, :mod:`kvstore.index`,
:mod:`kvstore.disk`, :mod:`kvstore.io`, :mod:`kvstore.tiers.remote`,
:mod:`kvstore.codecs` and :mod:`kvstore.cuda`.
"""
