"""The chunk engine, on the scheduler side: one extend batch's chunked requests looked
up (device chunk nodes, then host, disk and shared tiers), assembled, encoded where
missed, selected for recomputation, recomputed and stored.

It reaches SGLang only through ``sgl_pic.binding`` (phase batches, the KV pool's
accessors, the model's rotary embedding) and never imports SGLang itself.
"""
