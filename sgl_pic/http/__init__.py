"""The HTTP edge, in the server's HTTP process: chunk marks on SGLang's native and OpenAI
APIs, parsed, checked, signed and turned into SGLang requests; chat requests rendered by
the model's own template and cut into chunks; the operator's ``POST /pic/delete``; the
drift signal in OpenAI chat responses (``openai_meta``).

Nothing here holds KV. What the edge signs (``spans``, ``delete_command``) is checked
again on the scheduler side by ``sgl_pic.core.gate`` before anything runs.
Modules that read SGLang: ``middleware`` (its app and tokenizer manager),
``chat_render`` / ``chat_source`` (its chat path), ``delete_route`` (its admin auth),
``openai_meta`` (its chat response builder, through its HookRegistry).
"""
