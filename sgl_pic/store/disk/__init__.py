"""The local disk tier: ``DiskStore`` (``store``) with its start-up scan (``scan``), its
handling of bad files and failed reads (``files``) and its capacity after a full disk
(``capacity``). Callers import ``DiskStore`` from ``sgl_pic.store`` or
``sgl_pic.store.disk.store``; this package re-exports nothing.
"""
