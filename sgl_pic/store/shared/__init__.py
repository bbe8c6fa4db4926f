"""The shared chunk tier over Mooncake Store: ``SharedStore`` (``store``) and its parts,
reads (``reader``, ``blocks``, ``headers``), writes (``writer``, ``backfill``), deletions
(``deletion``), counters (``counts``), and the store service that
``python -m sgl_pic.store.shared.service`` runs (``service``). This package re-exports
nothing.
"""
