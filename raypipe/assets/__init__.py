"""Built-in assets: the Qwen vocabulary, chat templates and a tiny Qwen3 target, all made locally so nothing is
downloaded."""

# The folder inside a built target that holds its tokenizer when the model's own config would pick another tokenizer
# class (raypipe.target.tokenizer_path).
TOKENIZER_DIR = "tokenizer"
