"""Running the model: executors (in-process, or one Ray actor per pipeline stage), the
`Worker` that owns a model and its KV cache, the `ModelRunner` (input batch, forward,
sampler), n-gram drafting and the stage-to-stage activation pipe."""
