"""SGLang bindings: the code that touches SGLang's internals.

Plugin registration (radix cache backend, HookRegistry hooks), the ``sgl_pic`` radix
cache, the scheduler-side gate, phase forwards as SGLang-native extend batches, the
model runner's hooks and rotary embedding, server settings, metrics, fingerprints, the
launch-time self-check, process exit, and the CPU stand-ins SGLang imports on CPU.
"""
