"""SGLang integration: the only package of sgl_pic that imports SGLang internals."""
