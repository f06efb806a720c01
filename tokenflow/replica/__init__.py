"""Model execution: models, weights, tokenizer, runner, workers, executors and engines."""
