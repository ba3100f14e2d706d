"""Built-in assets: the Qwen vocabulary, chat templates and a tiny Qwen3 target, all made locally so nothing is
downloaded."""
