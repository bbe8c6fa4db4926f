"""Helpers shared by the tests: fakes of SGLang classes (checked against the real ones),
tiny models, prompts, chat-template fixtures, and the test server."""
