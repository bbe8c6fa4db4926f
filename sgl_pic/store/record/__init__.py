"""The chunk record file's parts: the header (``header``), the payload encoding
(``encode``), atomic writes and temp files (``write``) and checked reads (``read``).
Callers import the format from ``sgl_pic.store.format``, the public face over these
modules; this package re-exports nothing.
"""
