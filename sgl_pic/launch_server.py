"""``python -m sgl_pic.launch_server``: the server command's stable name.

The launcher is ``sgl_pic.cli.launch_server``; this module only runs it, so the command
stays the same for users, scripts and older checkouts (``bench/compare_paths.py`` starts
two trees by it). SGLang's spawned children re-import the parent's main module as
``__mp_main__``; that case registers the plugin in the child, as the launcher does.
"""

from sgl_pic.cli.launch_server import _register_in_spawned_child, main

__all__ = ["main"]

if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    _register_in_spawned_child()
