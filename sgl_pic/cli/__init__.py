"""Command lines: the server launcher (``python -m sgl_pic.launch_server``), the
per-model gate (``python -m sgl_pic.check``), offline calibration, and running the
server as a child process."""
