"""The README's questions to the default model, each with a word its greedy answer must contain
(checked with transformers' GGUF loader too): tests/cluster/test_quality.py asks them through
the API, tests/replica/test_quantized.py of the quantized path, bench/quantization.py keeps the
same list."""

QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is 2 + 3?", "5"),
    ("Is Tokyo in Japan? Reply with only the word yes.", "yes"),
]
