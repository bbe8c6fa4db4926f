"""The SGLang routes whose bodies the HTTP edge reads beyond the generic checks: the ones
it translates (chunk marks) and checks for generation options."""

GENERATE_PATH = "/generate"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
TRANSLATED_PATHS = (GENERATE_PATH, CHAT_PATH, COMPLETIONS_PATH)
