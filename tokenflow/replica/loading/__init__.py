"""Where a model comes from and how it is read: `resolve_model` (name or path -> source),
Hugging Face safetensors and GGUF sources, the tokenizer, the weight loader and the embedded
`tokenflow-tiny` model's assets."""
